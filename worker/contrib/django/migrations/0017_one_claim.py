"""The worker's schema at version 17 (schema/0017_one_claim.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0016_one_retry_one_record")]
    operations = [ApplyWorkerSchema(17)]
