"""The worker's schema at version 12 (schema/0012_results.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0011_pause_functions")]
    operations = [ApplyWorkerSchema(12)]
