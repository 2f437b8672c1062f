from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0003_invitations_and_default_tenant'),
    ]

    operations = [
        migrations.AddField(
            model_name='quota',
            name='high_priority',
            field=models.CharField(blank=True, choices=[('', "the platform's default (TRAINYARD_HIGH_PRIORITY)"), ('admins', 'tenant admins only'), ('everyone', 'every member who may submit'), ('nobody', 'nobody')], default='', help_text='who may submit jobs with priority high', max_length=10),
        ),
    ]
