from django.db import migrations


class Migration(migrations.Migration):
    """Learner.tensorboard holds more than TensorBoard's files now (metric counts, refused notes)."""

    dependencies = [
        ('jobs', '0019_queued_per_tenant'),
    ]

    operations = [
        migrations.RenameField(model_name='learner', old_name='tensorboard', new_name='ingest_state'),
    ]
