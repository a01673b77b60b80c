"""The worker's schema at version 20 (schema/0020_permits_by_claim.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0019_operator_checks")]
    operations = [ApplyWorkerSchema(20)]
