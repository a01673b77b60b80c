"""The worker's schema at version 14 (schema/0014_limits.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0013_trace_context")]
    operations = [ApplyWorkerSchema(14)]
