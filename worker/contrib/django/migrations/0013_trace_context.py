"""The worker's schema at version 13 (schema/0013_trace_context.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0012_results")]
    operations = [ApplyWorkerSchema(13)]
