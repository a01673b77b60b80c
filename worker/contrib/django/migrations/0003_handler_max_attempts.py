"""The worker's schema at version 3 (schema/0003_handler_max_attempts.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0002_locks_cron")]
    operations = [ApplyWorkerSchema(3)]
