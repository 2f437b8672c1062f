"""`manage.py token create USERNAME [--name NAME]` prints only the new key (for scripts)."""
import getpass

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from tenants.audit import acting_as
from tenants.models import ApiToken


class Command(BaseCommand):
    help = "Create API tokens."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a token and print its key")
        create.add_argument("username")
        create.add_argument("--name", default="default")

    def handle(self, *args, action, username, name, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}")
        with acting_as(f"command:token {action} ({getpass.getuser()})"):
            _, key = ApiToken.issue(user, name=name)
        self.stdout.write(key)
