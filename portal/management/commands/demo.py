"""`make demo`: the whole platform on embedded defaults, a demo tenant, user and token, the bundled
examples submitted, and the facts printed and written to var/demo.json. Ctrl-C stops everything."""
import json
import secrets
import signal
import sys
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from portal import env
from portal.harness import start_session
from portal.runner import StartupError

DEMO_EXAMPLES = ("pytorch-digits", "custom-shell")


class Command(BaseCommand):
    help = "Run the whole platform locally with demo data (foreground; Ctrl-C stops it)."

    def handle(self, *args, **options):
        port = env.integer("TRAINYARD_PORT", 8000, minimum=1)
        password = secrets.token_urlsafe(9)
        self.stdout.write("Starting Trainyard (Redis, web server, Celery worker, beat)...")
        try:
            session = start_session(settings.DATA_DIR, port=port, tenant="demo", username="demo", password=password,
                                    fresh_database=False, supervise=True)
        except StartupError as exc:
            raise CommandError(str(exc)) from None
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        # Ctrl-C must stop the demo even when it was started from a shell that ignores SIGINT.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            jobs = [session.submit(example) for example in DEMO_EXAMPLES]
            facts = {"url": session.url, "username": "demo", "password": password, "token": session.token}
            path = settings.DATA_DIR / "demo.json"
            path.write_text(json.dumps(facts, indent=2) + "\n")
            path.chmod(0o600)
            self.stdout.write(self.banner(facts, jobs, path))
            while True:
                time.sleep(1)
                for name in list(session.platform.processes):
                    session.platform.check_alive(name)
        except KeyboardInterrupt:
            pass
        except StartupError as exc:
            self.stderr.write(f"A platform process stopped: {exc}")
        finally:
            self.stdout.write("\nStopping Trainyard...")
            session.stop()
            self.stdout.write("Stopped.")

    def banner(self, facts, jobs, path):
        lines = [
            "",
            "Trainyard is running.",
            f"  Dashboard:  {facts['url']}/   (login: {facts['username']} / {facts['password']})",
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
