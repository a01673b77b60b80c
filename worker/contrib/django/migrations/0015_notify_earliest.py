"""The worker's schema at version 15 (schema/0015_notify_earliest.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0014_limits")]
    operations = [ApplyWorkerSchema(15)]
