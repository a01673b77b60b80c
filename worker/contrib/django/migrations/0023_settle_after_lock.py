"""The worker's schema at version 23 (schema/0023_settle_after_lock.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0022_workflows")]
    operations = [ApplyWorkerSchema(23)]
