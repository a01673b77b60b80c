"""The worker's schema at version 25 (schema/0025_task_history.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0024_pace_ahead")]
    operations = [ApplyWorkerSchema(25)]
