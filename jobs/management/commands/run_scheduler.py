"""`manage.py run_scheduler`: the scheduling loop (jobs.scheduler_loop), leader or standby, until
SIGTERM or SIGINT; the lease is let go on the way out, so a standby takes over at once."""
import signal
import threading

from django.core.management.base import BaseCommand
from django.db import connection

from jobs.scheduler_loop import SchedulerLoop


class Command(BaseCommand):
    help = "Run the scheduling loop: one process leads and runs the scheduling cycles, others stand by."

    def handle(self, *args, **options):
        # The loop is this process's one thread that queries: its connection is kept from cycle to
        # cycle (replaced when unusable), as a worker keeps its own, instead of one per cycle.
        connection.settings_dict["CONN_MAX_AGE"] = None
        stop = threading.Event()
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, lambda *_: stop.set())
        SchedulerLoop.from_settings(stop=stop).run()
