"""The worker's schema at version 26 (schema/0026_step_hops.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0025_task_history")]
    operations = [ApplyWorkerSchema(26)]
