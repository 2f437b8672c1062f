"""The jobs page filters by status within a tenant, newest first: one index range scan (jobs.listing)."""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0005_job_preempted_reason"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="job",
            index=models.Index(fields=["tenant", "status", "-created_at"], name="job_tenant_status_created"),
        ),
    ]
