"""The worker's schema at version 29 (schema/0029_bulk_cancel_settles.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0028_step_acks")]
    operations = [ApplyWorkerSchema(29)]
