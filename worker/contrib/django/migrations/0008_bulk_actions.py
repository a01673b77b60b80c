"""The worker's schema at version 8 (schema/0008_bulk_actions.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0007_operator_indexes")]
    operations = [ApplyWorkerSchema(8)]
