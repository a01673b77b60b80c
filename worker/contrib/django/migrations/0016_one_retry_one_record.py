"""The worker's schema at version 16 (schema/0016_one_retry_one_record.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0015_notify_earliest")]
    operations = [ApplyWorkerSchema(16)]
