"""The worker's schema at version 21 (schema/0021_workflows.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0020_waiting_state")]
    operations = [ApplyWorkerSchema(21)]
