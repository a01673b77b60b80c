"""The worker's schema at version 21 (schema/0021_waiting_state.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0020_permits_by_claim")]
    operations = [ApplyWorkerSchema(21)]
