"""The Django app, installed for its migrations (``manage.py migrate`` makes the queue's schema:
see ``schema``) and its management command (``manage.py worker_run``)."""

from __future__ import annotations

from django.apps import AppConfig


class WorkerConfig(AppConfig):
    name = "worker.contrib.django"
    label = "worker_django"  # the default, "django", would read as Django itself
    verbose_name = "worker (PostgreSQL work queue)"
