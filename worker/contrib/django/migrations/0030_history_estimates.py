"""The worker's schema at version 30 (schema/0030_history_estimates.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0029_bulk_cancel_settles")]
    operations = [ApplyWorkerSchema(30)]
