"""The worker's schema at version 4 (schema/0004_refuse_what_cannot_run.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0003_handler_max_attempts")]
    operations = [ApplyWorkerSchema(4)]
