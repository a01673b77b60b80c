"""The worker's schema at version 6 (schema/0006_claim_at_scale.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0005_scheduled_state")]
    operations = [ApplyWorkerSchema(6)]
