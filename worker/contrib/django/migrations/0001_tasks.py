"""The worker's schema at version 1 (schema/0001_tasks.sql)."""

from django.db import migrations

from ..schema import ApplyWorkerSchema


class Migration(migrations.Migration):
    initial = True
    atomic = False  # the worker's migrator commits each version on its own
    dependencies = []
    operations = [ApplyWorkerSchema(1)]
