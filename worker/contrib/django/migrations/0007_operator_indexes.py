"""The worker's schema at version 7 (schema/0007_operator_indexes.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0006_claim_at_scale")]
    operations = [ApplyWorkerSchema(7)]
