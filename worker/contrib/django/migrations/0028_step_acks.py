"""The worker's schema at version 28 (schema/0028_step_acks.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0027_permits_once")]
    operations = [ApplyWorkerSchema(28)]
