"""The worker's schema at version 2 (schema/0002_locks_cron.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0001_tasks")]
    operations = [ApplyWorkerSchema(2)]
