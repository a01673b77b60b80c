"""The worker's schema at version 34 (schema/0034_wide_workflow_plans.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = [("worker_django", "0033_edges_checked_by_key")]
    operations = [ApplyWorkerSchema(34)]
