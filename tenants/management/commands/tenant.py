"""`manage.py tenant create SLUG [...]` and `manage.py tenant adduser SLUG USERNAME --role R`.

Idempotent: running the same command twice leaves the same state and says so.
"""
import argparse
import getpass

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils.text import slugify

from trainyard import units
from tenants import quotas
from tenants.audit import acting_as
from tenants.models import Membership, Quota, Tenant


class Command(BaseCommand):
    help = "Create tenants and add users to them."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a tenant (or update its name)")
        create.add_argument("slug")
        create.add_argument("--name", default="")
        create.add_argument("--gpus", type=int, help="GPUs in use at once")
        create.add_argument("--cpus", type=float, help="CPUs in use at once")
        create.add_argument("--memory", help="memory in use at once, e.g. 64GiB")
        create.add_argument("--jobs", type=int, help="jobs running at once")
        create.add_argument("--gpus-per-user", type=int, help="GPUs one member may hold at once")
        create.add_argument("--gpu-hours", type=float, help="GPU-hours per period")
        create.add_argument("--cpu-hours", type=float, help="CPU-hours per period")
        create.add_argument("--storage",
                            help="stored results, checkpoints, logs and code archives of all its jobs, e.g. 500GiB")
        create.add_argument("--disk-per-job", help="largest disk cap of one job's folder or log, e.g. 50GiB")
        create.add_argument("--period", choices=[p.value for p in Quota.Period])
        create.add_argument("--budget-mode", choices=[m.value for m in Quota.BudgetMode])
        create.add_argument("--can-borrow", action=argparse.BooleanOptionalAction, default=None,
                            help="may use idle capacity beyond its quota (preemptible)")
        create.add_argument("--high-priority", choices=[r.value for r in Quota.HighPriority if r.value],
                            help="who may submit jobs with priority high (default: TRAINYARD_HIGH_PRIORITY)")
        create.add_argument("--queued-jobs", type=int,
                            help="jobs it may have queued at once (default: TRAINYARD_MAX_QUEUED_JOBS)")
        create.add_argument("--submissions-per-minute", type=int,
                            help="job submissions per minute (default: TRAINYARD_SUBMITS_PER_MINUTE)")
        adduser = sub.add_parser("adduser", help="add a user to a tenant (creating the user if needed)")
        adduser.add_argument("slug")
        adduser.add_argument("username")
        adduser.add_argument("--role", choices=[r.value for r in Membership.Role], default="researcher")
        adduser.add_argument("--password", default=None)
        adduser.add_argument("--email", default="")

    def handle(self, *args, action, **options):
        with acting_as(f"command:tenant {action} ({getpass.getuser()})"):
            if action == "create":
                self.create(options["slug"], options["name"], self.quota_options(options))
            else:
                self.adduser(options["slug"], options["username"], options["role"], options["password"],
                             options["email"])

    @staticmethod
    def quota_options(options):
        limits = {name: options[name] for name in ("gpus", "cpus", "jobs", "gpus_per_user", "gpu_hours", "cpu_hours",
                                                   "period", "budget_mode", "can_borrow", "high_priority",
                                                   *Quota.INTAKE)
                  if options[name] is not None}
        for option, name in (("memory", "memory_bytes"), ("storage", "storage_bytes"),
                             ("disk_per_job", "disk_per_job_bytes")):
            if options[option] is not None:
                try:
                    limits[name] = units.parse_memory_size(options[option])
                except ValueError as exc:
                    flag = option.replace("_", "-")
                    raise CommandError(f"--{flag}: {options[option]!r} is not a size; {exc}") from None
        for name, value in limits.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise CommandError(f"--{name.replace('_', '-')} must not be negative")
        return limits

    @transaction.atomic
    def create(self, slug, name, limits):
        if slugify(slug) != slug:
            raise CommandError(f"{slug!r} is not a valid slug (lowercase letters, digits, hyphens)")
        tenant, created = Tenant.objects.get_or_create(slug=slug, defaults={"name": name or slug})
        if not created and name and tenant.name != name:
            tenant.name = name
            tenant.save(update_fields=["name"])
        self.stdout.write(f"tenant {slug} {'created' if created else 'exists'}")
        if limits:
            quota = quotas.set_quota(tenant, **limits)
            shown = ", ".join(f"{k}={v}" for k, v in quota.as_dict().items() if v is not None)
            self.stdout.write(f"quota of {slug}: {shown}")

    @transaction.atomic
    def adduser(self, slug, username, role, password, email):
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            raise CommandError(f"no tenant {slug!r}; create it with: manage.py tenant create {slug}")
        user, created = get_user_model().objects.get_or_create(username=username, defaults={"email": email})
        if password:
            user.set_password(password)
            user.save()
        elif created:
            user.set_unusable_password()
            user.save()
        membership, joined = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
        self.stdout.write(f"user {username} {'added to' if joined else 'updated in'} {slug} as {role}")
