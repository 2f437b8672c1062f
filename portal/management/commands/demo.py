"""`make demo`: the whole platform on embedded defaults, a demo tenant, user and token, the bundled
examples submitted, and the facts printed and written to var/demo.json.

Ctrl-C, SIGTERM (`kill`, `make` being stopped, a service manager) and SIGHUP (the terminal closing)
all stop everything it started, at any moment, start-up included: the parts run in sessions of their
own, so nothing else would stop them. TRAINYARD_DEMO_EXAMPLES names the examples to submit
(comma-separated; `none` for none)."""
import json
import os
import secrets
import signal
import sys
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from portal import env
from portal.runner import (PROJECT_ROOT, StartupError, free_port, manage, port_is_free, start_platform,
                           stop_learner_agents)
from tenants.audit import acting_as
from trainyard import Client

DEMO_EXAMPLES = "pytorch-digits,custom-shell"
EXAMPLES = PROJECT_ROOT / "examples"
DEMO_VIRTUAL_GPUS = 4
DEMO_TENANT_ADMIN = "demo-admin"
DEFAULT_REDIS_PORT = 6390  # portal.settings' embedded Redis port when nothing names one
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_on_signals():
    """Make each stop signal end the command the way Ctrl-C does (KeyboardInterrupt, so every
    `finally` and the start-up's own clean-up run); a repeated signal must not cut the clean-up short."""
    def interrupt(signum, frame):
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)
    for sig in STOP_SIGNALS:
        signal.signal(sig, interrupt)


def demo_environment():
    """What the demo's processes get beyond this environment. No GPU here? The demo advertises four
    virtual ones so scheduling, quotas and preemption show. Webhooks may reach this machine's own
    addresses (a receiver on the laptop is what one tries first) unless TRAINYARD_WEBHOOK_ALLOW_PRIVATE
    says otherwise."""
    return {"TRAINYARD_LOCAL_GPUS": os.environ.get("TRAINYARD_LOCAL_GPUS", str(DEMO_VIRTUAL_GPUS)),
            "TRAINYARD_WEBHOOK_ALLOW_PRIVATE": os.environ.get("TRAINYARD_WEBHOOK_ALLOW_PRIVATE", "true")}


def start_again_with_an_embedded_redis_port():
    """Without REDIS_URL or TRAINYARD_EMBEDDED_REDIS_PORT, choose the embedded Redis's port (6390, or a
    free one when it is taken, so a second checkout's demo can run) and start this command again with
    it: this process's own settings (its channel layer, cache and broker) must name the Redis its
    platform runs, or what it publishes goes nowhere."""
    if os.environ.get("REDIS_URL") or os.environ.get("TRAINYARD_EMBEDDED_REDIS_PORT"):
        return
    port = DEFAULT_REDIS_PORT if port_is_free(DEFAULT_REDIS_PORT) else free_port()
    os.execve(sys.executable, [sys.executable, *sys.argv],
              dict(os.environ, TRAINYARD_EMBEDDED_REDIS_PORT=str(port)))


def demo_examples():
    names = env.text("TRAINYARD_DEMO_EXAMPLES", DEMO_EXAMPLES)
    return [] if names.strip() == "none" else [name.strip() for name in names.split(",") if name.strip()]


class Command(BaseCommand):
    help = "Run the whole platform locally with demo data (foreground; Ctrl-C, SIGTERM or SIGHUP stops it)."

    def handle(self, *args, **options):
        start_again_with_an_embedded_redis_port()
        port = env.integer("TRAINYARD_PORT", 8000, minimum=1)
        password = secrets.token_urlsafe(9)
        examples = demo_examples()
        stop_on_signals()
        self.stdout.write("Starting Trainyard (Redis, web server, Celery worker, scheduling loop, beat)...")
        try:
            platform, token = start_platform(settings.DATA_DIR, port=port, tenant="demo", username="demo",
                                             password=password, env=demo_environment(), supervise=True)
        except StartupError as exc:
            raise CommandError(str(exc)) from None
        except KeyboardInterrupt:  # start_platform stopped what it had started
            self.stdout.write("\nStopped during start-up.")
            return
        port_file = None if os.environ.get("REDIS_URL") else settings.EMBEDDED_REDIS_PORT_FILE
        if port_file:  # where `manage.py` commands beside the demo find its Redis (portal.settings)
            port_file.write_text(f"{settings.EMBEDDED_REDIS_PORT}\n")
        try:
            self.platform_admin(platform, password)
            client = Client(platform.url, token, "demo")
            jobs = [client.submit(EXAMPLES / name / "manifest.yml", EXAMPLES / name) for name in examples]
            facts = {"url": platform.url, "username": "demo", "password": password, "token": token,
                     "admin_username": "admin", "tenant_admin_username": DEMO_TENANT_ADMIN,
                     "redis_url": settings.REDIS_URL, "database_url": settings.DATABASE_URL}
            path = settings.DATA_DIR / "demo.json"
            path.write_text(json.dumps(facts, indent=2) + "\n")
            path.chmod(0o600)
            self.stdout.write(self.banner(facts, jobs, path))
            while True:
                time.sleep(1)
                for name in platform.names():
                    platform.check_alive(name)
        except KeyboardInterrupt:
            pass
        except StartupError as exc:
            self.stderr.write(f"A platform process stopped: {exc}")
        finally:
            self.stdout.write("\nStopping Trainyard...")
            platform.stop()
            stop_learner_agents(settings.DATA_DIR)
            if port_file:
                port_file.unlink(missing_ok=True)
            self.stdout.write("Stopped.")

    @staticmethod
    def platform_admin(platform, password):
        """An `admin` platform admin and a `demo-admin` tenant admin (same password as `demo`), and a
        quota on the demo tenant, so the admin console has usage bars to show. The quota goes through the platform's own command, whose
        change reaches the running scheduler."""
        with acting_as("command:demo"):
            admin, _ = get_user_model().objects.get_or_create(username="admin")
            admin.is_staff = admin.is_superuser = True
            admin.set_password(password)
            admin.save()
        manage(platform.env, "tenant", "create", "demo", "--gpus", str(DEMO_VIRTUAL_GPUS), "--gpu-hours", "100")
        # A tenant admin too, so members, invitations and tenant-wide webhooks can be tried.
        manage(platform.env, "tenant", "adduser", "demo", DEMO_TENANT_ADMIN, "--role", "admin")
        with acting_as("command:demo"):  # the password here, not on a command line others can read
            tenant_admin = get_user_model().objects.get(username=DEMO_TENANT_ADMIN)
            tenant_admin.set_password(password)
            tenant_admin.save()

    def banner(self, facts, jobs, path):
        lines = [
            "",
            "Trainyard is running.",
            f"  Dashboard:  {facts['url']}/   (login: {facts['username']} / {facts['password']})",
            f"  Admin:      {facts['url']}/admin/   (login: admin / {facts['password']})",
            f"  Tenant admin: login {facts['tenant_admin_username']} (same password): members, invitations, webhooks",
            f"  API token:  {facts['token']}",
            f"  API docs:   {facts['url']}/api/docs/",
            f"  Saved to:   {path}",
            f"  Logs:       {settings.DATA_DIR / 'logs'}/",
            "",
            "Submitted example jobs:",
            *[f"  {job['id']}  {job['name']:<16} {facts['url']}/jobs/{job['id']}/" for job in jobs],
            "",
            "Try the CLI:",
            f"  export TRAINYARD_URL={facts['url']} TRAINYARD_TOKEN={facts['token']}",
            "  .venv/bin/trainyard train examples/pytorch-digits/manifest.yml examples/pytorch-digits --follow",
            "",
            "Press Ctrl-C to stop.",
        ]
        return "\n".join(lines)
