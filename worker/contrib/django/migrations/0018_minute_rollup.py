"""The worker's schema at version 18 (schema/0018_minute_rollup.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0017_one_claim")]
    operations = [ApplyWorkerSchema(18)]
