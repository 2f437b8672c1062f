import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0013_log_caps'),
    ]

    operations = [
        migrations.CreateModel(
            name='ResourceSample',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('attempt', models.PositiveIntegerField(default=1)),
                ('learner', models.PositiveIntegerField(default=0)),
                ('time', models.DateTimeField()),
                ('cpu_cores', models.FloatField()),
                ('memory_bytes', models.BigIntegerField()),
                ('memory_peak_bytes', models.BigIntegerField()),
                ('memory_limit_bytes', models.BigIntegerField(blank=True, null=True)),
                ('gpus', models.JSONField(blank=True, default=list)),
                ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='resource_samples', to='jobs.job')),
            ],
            options={
                'indexes': [models.Index(fields=['job', 'id'], name='jobs_resour_job_id_ae5782_idx')],
            },
        ),
    ]
