"""The worker's schema at version 5 (schema/0005_scheduled_state.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0004_refuse_what_cannot_run")]
    operations = [ApplyWorkerSchema(5)]
