"""The worker's schema at version 9 (schema/0009_console.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0008_bulk_actions")]
    operations = [ApplyWorkerSchema(9)]
