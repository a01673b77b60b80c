"""The queue's schema as Django migrations, so ``python manage.py migrate`` sets it up.

Each migration of the app (``worker_django``, in ``migrations/``) mirrors one of the worker's own
(``schema/NNNN_name.sql``, the files ``worker migrate`` applies), under the same name, and runs
``ApplyWorkerSchema(NNNN)``: ``worker.db.migrate.migrate`` up to that version, in the schema of
every ``WorkerBackend`` of ``TASKS`` whose ``DATABASE`` is the database being migrated. It is
the worker's own migrator (an advisory lock, one transaction per file, a version table in the
schema), so a schema already migrated by ``worker migrate`` gets nothing twice, and
``worker migrate`` after Django finds nothing to do.

A release whose schema gains ``schema/NNNN_name.sql`` adds ``migrations/NNNN_name.py`` (a copy of
the last one with its number, name and dependency changed); tests/test_django_migrations.py
fails until it does. The migrations cannot be unapplied: the worker's migrations have no way
back, and the schema holds the tasks.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import router
from django.db.migrations.exceptions import IrreversibleError
from django.db.migrations.operations.base import Operation, OperationCategory
from django.utils.module_loading import import_string

from worker.db.migrate import migrate

from .backend import WorkerBackend
from .compat import task_backends


def backends_on(alias: str) -> list[WorkerBackend]:
    """The ``WorkerBackend``s of ``TASKS`` that write to the database ``alias``, one per schema."""
    found: dict[str, WorkerBackend] = {}
    for name, params in (getattr(settings, "TASKS", None) or {}).items():
        try:
            kind = import_string(str(params.get("BACKEND", "")))
        except ImportError:
            continue  # not ours, and Django's own checks say what is wrong with it
        if isinstance(kind, type) and issubclass(kind, WorkerBackend):
            backend = task_backends[name]
            if backend.database == alias:
                found.setdefault(backend.schema, backend)
    return list(found.values())


class ApplyWorkerSchema(Operation):
    """Bring the queue's schema to ``version`` (``schema/NNNN_*.sql`` up to NNNN), on the
    database being migrated, in the schema of each of its backends; nothing on a database no
    ``WorkerBackend`` uses, nor on one that is not PostgreSQL."""

    reduces_to_sql = False  # `manage.py sqlmigrate` shows no SQL for it: the worker applies it
    atomic = False  # each worker migration commits on its own (worker.db.migrate)
    category = OperationCategory.PYTHON

    def __init__(self, version: int) -> None:
        self.version = version

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (f"{__name__}.{type(self).__qualname__}", [self.version], {})

    def state_forwards(self, app_label: str, state: Any) -> None:
        """No models: Django's state does not change."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        alias = schema_editor.connection.alias
        if schema_editor.connection.vendor != "postgresql":
            return
        if not router.allow_migrate(alias, app_label):
            return
        for backend in backends_on(alias):
            migrate(backend.connection(), backend.schema, up_to=self.version)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        alias = schema_editor.connection.alias
        schemas = ", ".join(b.schema for b in backends_on(alias)) or "worker"
        raise IrreversibleError(
            f"{app_label}'s migrations cannot be unapplied: the worker's schema ({schemas}) "
            "keeps its tables and its tasks. To remove the queue, drop the schema yourself "
            "(DROP SCHEMA ... CASCADE deletes every task), then run "
            f"`python manage.py migrate {app_label} zero --fake`"
        )

    def describe(self) -> str:
        return f"Bring the worker's schema to version {self.version}"


__all__ = ["ApplyWorkerSchema", "backends_on"]
