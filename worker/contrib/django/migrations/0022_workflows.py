"""The worker's schema at version 22 (schema/0022_workflows.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0021_waiting_state")]
    operations = [ApplyWorkerSchema(22)]
