"""The worker's schema at version 19 (schema/0019_operator_checks.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0018_minute_rollup")]
    operations = [ApplyWorkerSchema(19)]
