"""Room on each page of the jobs table for a row's next version (PostgreSQL's fillfactor).

A queued job's wait reason changes with its place in the queue, so the scheduler rewrites the
reasons of every queued job behind an admission. On full pages (the default fillfactor, 100) none
of those rewrites stayed on its page (29 of 100,000): each one wrote a new entry into every index
of the table, and ten rewrites of 10,000 queued jobs' reasons grew the table from 10 MB to 107 MB
(until a VACUUM). With 30% of each page left free, 80% of them stayed on their page (HOT updates, no
index entries), the table grew to 40 MB, and a rewrite of 10,000 reasons took 0.3 s instead of
0.9 s (an idle 2-core machine). Pages already written keep their fill until they are rewritten
(VACUUM FULL); new rows get the room. SQLite has no such setting.
"""
from django.db import migrations

FILLFACTOR = 70


def set_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        table = schema_editor.quote_name(apps.get_model("jobs", "Job")._meta.db_table)
        schema_editor.execute(f"ALTER TABLE {table} SET (fillfactor = {FILLFACTOR})")


def reset_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        table = schema_editor.quote_name(apps.get_model("jobs", "Job")._meta.db_table)
        schema_editor.execute(f"ALTER TABLE {table} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("jobs", "0011_learner_tensorboard")]
    operations = [migrations.RunPython(set_fillfactor, reset_fillfactor)]
