"""The worker's schema at version 31 (schema/0031_settle_missed_by_key.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0030_history_estimates")]
    operations = [ApplyWorkerSchema(31)]
