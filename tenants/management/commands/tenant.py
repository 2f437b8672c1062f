"""`manage.py tenant create SLUG [...]` and `manage.py tenant adduser SLUG USERNAME --role R`.

Idempotent: running the same command twice leaves the same state and says so.
"""
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils.text import slugify

from tenants.models import Membership, Tenant


class Command(BaseCommand):
    help = "Create tenants and add users to them."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a tenant (or update its name)")
        create.add_argument("slug")
        create.add_argument("--name", default="")
        for flag in ("--gpus", "--cpus", "--memory", "--jobs", "--gpu-hours"):
            # Accepted now so scripts written against SPEC §1 work; quotas are enforced by the
            # tenants/quotas issue.
            create.add_argument(flag, default=None)
        adduser = sub.add_parser("adduser", help="add a user to a tenant (creating the user if needed)")
        adduser.add_argument("slug")
        adduser.add_argument("username")
        adduser.add_argument("--role", choices=[r.value for r in Membership.Role], default="researcher")
        adduser.add_argument("--password", default=None)
        adduser.add_argument("--email", default="")

    def handle(self, *args, action, **options):
        if action == "create":
            self.create(options["slug"], options["name"])
        else:
            self.adduser(options["slug"], options["username"], options["role"], options["password"],
                         options["email"])

    def create(self, slug, name):
        if slugify(slug) != slug:
            raise CommandError(f"{slug!r} is not a valid slug (lowercase letters, digits, hyphens)")
        tenant, created = Tenant.objects.get_or_create(slug=slug, defaults={"name": name or slug})
        if not created and name and tenant.name != name:
            tenant.name = name
            tenant.save(update_fields=["name"])
        self.stdout.write(f"tenant {slug} {'created' if created else 'exists'}")

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
