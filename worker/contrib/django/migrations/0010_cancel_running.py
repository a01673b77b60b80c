"""The worker's schema at version 10 (schema/0010_cancel_running.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0009_console")]
    operations = [ApplyWorkerSchema(10)]
