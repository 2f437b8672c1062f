from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0004_quota_high_priority"),
    ]

    operations = [
        migrations.AddField(
            model_name="quota",
            name="storage_bytes",
            field=models.BigIntegerField(blank=True, help_text="stored results, checkpoints and logs of all its jobs (bytes)", null=True),
        ),
        migrations.AddField(
            model_name="quota",
            name="disk_per_job_bytes",
            field=models.BigIntegerField(blank=True, help_text="largest disk cap a job may have per folder or log (bytes)", null=True),
        ),
    ]
