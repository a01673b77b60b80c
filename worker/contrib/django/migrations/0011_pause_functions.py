"""The worker's schema at version 11 (schema/0011_pause_functions.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0010_cancel_running")]
    operations = [ApplyWorkerSchema(11)]
