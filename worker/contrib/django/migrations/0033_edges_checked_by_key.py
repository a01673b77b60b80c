"""The worker's schema at version 33 (schema/0033_edges_checked_by_key.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0032_step_settlement_by_key")]
    operations = [ApplyWorkerSchema(33)]
