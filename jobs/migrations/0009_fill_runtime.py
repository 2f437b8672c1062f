"""Fill Job.runtime for the jobs submitted before it existed, from their stored manifests.

A manifest that no longer parses (a rule tightened since) does not stop the migration: its job is
marked unreadable (jobs.runtime.unreadable) and fails with that reason if a step ever needs it."""
from django.db import migrations

from jobs import runtime
from trainyard.manifest import ManifestError, parse_manifest

BATCH = 500


def fill(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    pending = []
    for job in Job.objects.filter(runtime={}).only("id", "manifest_yaml").iterator(BATCH):
        try:
            job.runtime = runtime.from_manifest(parse_manifest(job.manifest_yaml))
        except (ManifestError, ValueError, TypeError) as exc:
            job.runtime = runtime.unreadable(exc)
        pending.append(job)
        if len(pending) >= BATCH:
            Job.objects.bulk_update(pending, ["runtime"])
            pending = []
    Job.objects.bulk_update(pending, ["runtime"])


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0008_outbox_and_runtime"),
    ]

    operations = [
        migrations.RunPython(fill, migrations.RunPython.noop),
    ]
