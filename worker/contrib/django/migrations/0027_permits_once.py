"""The worker's schema at version 27 (schema/0027_permits_once.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0026_step_hops")]
    operations = [ApplyWorkerSchema(27)]
