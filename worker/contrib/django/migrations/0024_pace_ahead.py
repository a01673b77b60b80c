"""The worker's schema at version 24 (schema/0025_pace_ahead.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0023_settle_after_lock")]
    operations = [ApplyWorkerSchema(24)]
