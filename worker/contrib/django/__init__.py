"""A backend for Django's Tasks framework (``django.tasks``, Django 6.0 and newer; the
``django-tasks`` backport on older Django).

Settings::

    INSTALLED_APPS = [..., "worker.contrib.django"]
    TASKS = {"default": {"BACKEND": "worker.contrib.django.WorkerBackend"}}

``python manage.py migrate`` makes the queue's schema (``schema``). ``@task`` functions enqueued
with ``.enqueue()`` become rows of the queue, written on Django's own database connection (so
inside ``transaction.atomic()`` they commit or roll back with it), and ``python manage.py
worker_run`` runs them. See ``backend`` for the mapping of Django's fields to
ours, and ``registry`` for how a worker finds a task by its import path.

This package imports Django; ``import worker`` never imports this package.
"""

from .backend import WorkerBackend

__all__ = ["WorkerBackend"]
