"""``WorkerBackend``: Django's Tasks framework on top of this queue.

How Django's task maps to a row:

- the task's import path (``Task.module_path``, e.g. ``shop.tasks.send_receipt``) is the row's
  task name; the worker imports it by that path (see ``registry``);
- ``args`` and ``kwargs`` become the payload ``{"args": [...], "kwargs": {...}}`` (JSON, as
  Django requires);
- ``priority`` (-100 to 100, higher first) is the row's priority as is: both run higher first,
  and ours takes any of Django's values;
- ``run_after`` is the row's ``run_at`` (an aware datetime; a naive one is read in Django's
  current time zone, as Django reads naive datetimes when ``USE_TZ`` is off);
- ``queue_name`` is the row's queue;
- the result id is the row's id, as a string.

The row is written on Django's own connection to ``OPTIONS["DATABASE"]`` (default
``"default"``), so inside ``transaction.atomic()`` it commits or rolls back with the caller's
writes. ``get_result()`` reads the row back on that same connection.

OPTIONS: ``DATABASE`` (alias, default ``"default"``), ``SCHEMA`` (the queue's schema, default
``"worker"``, made by ``manage.py migrate`` on that database: see ``schema``), ``MAX_ATTEMPTS``
(runs before a task that raises is FAILED, default 1: Django's tasks have no retry of their own,
and a task that raised is expected to read FAILED).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.utils import timezone

from worker import SchemaMissing, enqueue
from worker.db.migrate import schema_errors, schema_missing
from worker.db.sql import queries, validate_schema_name

from .compat import (
    BaseTaskBackend,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_enqueued,
)

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

# Our states as Django's statuses. A cancelled task reads FAILED (Django has no other end that
# is not a success), with a TaskCancelled error.
STATUS = {
    "scheduled": TaskResultStatus.READY,
    "queued": TaskResultStatus.READY,
    "in_progress": TaskResultStatus.RUNNING,
    "done": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}


def payload_of(args: Any, kwargs: Any) -> dict[str, Any]:
    return {"args": list(args), "kwargs": dict(kwargs)}


def arguments(payload: Any) -> tuple[list[Any], dict[str, Any]]:
    """(args, kwargs) from a row's payload; ValueError for one no Django backend wrote."""
    if (
        not isinstance(payload, dict)
        or set(payload) != {"args", "kwargs"}
        or not isinstance(payload["args"], list)
        or not isinstance(payload["kwargs"], dict)
    ):
        raise ValueError(
            'a Django task\'s payload is {"args": [...], "kwargs": {...}}, not '
            f"{str(payload)[:200]}"
        )
    return payload["args"], payload["kwargs"]


def error_class_path(text: str) -> str:
    """The exception class an error text of ours names (``Type: message``), as a dotted path:
    built-in exceptions are qualified (``builtins.ValueError``) so that Django's
    ``TaskError.exception_class`` can import them; others keep the bare name the worker
    recorded."""
    name = text.split(":", 1)[0].strip() if ":" in text else "Exception"
    if "." not in name and isinstance(getattr(builtins, name, None), type):
        return f"builtins.{name}"
    return name


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class WorkerBackend(BaseTaskBackend):
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database = str(self.options.get("DATABASE", "default"))
        self.schema = validate_schema_name(str(self.options.get("SCHEMA", "worker")))
        attempts = self.options.get("MAX_ATTEMPTS", 1)
        if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['MAX_ATTEMPTS'] must be an integer of at least 1, "
                f"not {attempts!r}"
            )
        self.max_attempts = attempts

    # -- the database ---------------------------------------------------------------------------

    def connection(self) -> psycopg.Connection:
        """Django's own psycopg connection to our database (opened if need be): what we write
        on it joins whatever transaction Django has open there."""
        problem = self._database_problem()
        if problem:
            raise ImproperlyConfigured(problem)
        django_conn = connections[self.database]
        django_conn.ensure_connection()
        raw = django_conn.connection
        if not isinstance(raw, psycopg.Connection):
            raise ImproperlyConfigured(
                f"TASKS[{self.alias!r}] needs Django to connect with psycopg 3; "
                f"DATABASES[{self.database!r}] uses {type(raw).__module__} (uninstall psycopg2, "
                "or install psycopg)"
            )
        return raw

    def _database_problem(self) -> str | None:
        if self.database not in connections.settings:
            return (
                f"TASKS[{self.alias!r}]['OPTIONS']['DATABASE'] is {self.database!r}, which is not "
                "in DATABASES"
            )
        vendor = connections[self.database].vendor
        if vendor != "postgresql":
            return (
                f"TASKS[{self.alias!r}] uses worker.contrib.django.WorkerBackend, which needs a "
                f"PostgreSQL database; DATABASES[{self.database!r}] is {vendor}"
            )
        return None

    def migrate_command(self) -> str:
        """What sets our schema up under Django: the app's migrations, on our database."""
        database = "" if self.database == "default" else f" --database {self.database}"
        return f"python manage.py migrate{database}"

    def with_django_fix(self, exc: SchemaMissing) -> SchemaMissing:
        """``exc`` naming the Django command that fixes it instead of ``worker migrate``."""
        if exc.schema is None:
            return exc
        return schema_missing(
            exc.schema, exc.version, needed=exc.needed, fix=self.migrate_command()
        )

    @contextlib.contextmanager
    def _schema_errors(self) -> Iterator[None]:
        """A missing or older schema raises ``SchemaMissing`` naming ``manage.py migrate``."""
        try:
            with schema_errors(self.schema):
                yield
        except SchemaMissing as exc:
            raise self.with_django_fix(exc) from None

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        problem = self._database_problem()
        messages = list(super().check(**kwargs))
        if problem:
            messages.append(checks.Error(problem, id="worker.E001"))
        return messages

    # -- producing ------------------------------------------------------------------------------

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        result = TaskResult(
            task=task,
            id="",  # set below, once the row exists
            status=TaskResultStatus.READY,
            enqueued_at=None,
            started_at=None,
            last_attempted_at=None,
            finished_at=None,
            args=args,  # normalised to JSON by TaskResult itself: a TypeError here, if not JSON
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        run_at = task.run_after
        if run_at is not None and timezone.is_naive(run_at):
            # Only with USE_TZ off (Django refuses naive datetimes otherwise): Django's own
            # reading of a naive datetime, in the current time zone.
            run_at = timezone.make_aware(run_at)
        with self._schema_errors():
            task_id = enqueue(
                self.connection(),
                task.module_path,
                payload_of(result.args, result.kwargs),
                queue=task.queue_name,
                run_at=run_at,
                priority=task.priority,
                max_attempts=self.max_attempts,
                schema=self.schema,
            )
        object.__setattr__(result, "id", str(task_id))
        object.__setattr__(result, "enqueued_at", timezone.now())
        task_enqueued.send(type(self), task_result=result)
        return result

    # -- results --------------------------------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult:
        try:
            task_id = int(str(result_id))
        except ValueError:
            raise TaskResultDoesNotExist(f"no task {result_id!r}: ids are integers") from None
        statement = queries(self.schema, SQL_DIR)["django_result"]
        with self._schema_errors():
            row = self.connection().execute(statement, {"id": task_id}).fetchone()
        if row is None:
            raise TaskResultDoesNotExist(f"no task {task_id} (never enqueued, or purged)")
        return self._result(row)

    def _result(self, row: tuple[Any, ...]) -> TaskResult:
        (task_id, name, state, payload, value, last_error, history, attempts, worker_id) = row[:9]
        enqueued_at, started_at, finished_at = row[9:12]
        payload, value, history = (_json(text) for text in (payload, value, history))
        task = self._task(task_id, name)
        try:
            args, kwargs = arguments(payload)
        except ValueError as exc:
            raise TaskResultDoesNotExist(f"task {task_id} is not a Django task: {exc}") from None
        errors = self._errors(history, state, last_error, attempts)
        if state == "cancelled":
            errors.append(TaskError(exception_class_path="worker.TaskCancelled", traceback=""))
        result = TaskResult(
            task=task,
            id=str(task_id),
            status=STATUS.get(state, TaskResultStatus.READY),
            enqueued_at=enqueued_at,
            started_at=started_at,
            last_attempted_at=started_at,
            finished_at=finished_at if state in ("done", "failed", "cancelled") else None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=errors,
            # Django counts attempts as len(worker_ids): one entry per attempt we counted.
            worker_ids=[worker_id] * attempts if worker_id else [],
        )
        object.__setattr__(result, "_return_value", value)
        return result

    @staticmethod
    def _errors(history: Any, state: str, last_error: str | None, attempts: int) -> list[TaskError]:
        """One error per failed attempt, oldest first, from the row's error history (its last
        entries; hand-backs, which were not the task's failures, left out). The history cuts
        each text; the latest attempt's is whole in last_error."""
        entries = [
            e
            for e in (history if isinstance(history, list) else [])
            if isinstance(e, dict) and e.get("counted", True) is not False
        ]
        texts = [str(e.get("error", "")) for e in entries]
        latest = bool(entries) and entries[-1].get("attempt") == attempts
        if last_error and state == "failed":
            if latest:
                texts[-1] = last_error
            else:
                texts.append(last_error)
        return [TaskError(exception_class_path=error_class_path(t), traceback=t) for t in texts]

    def _task(self, task_id: int, name: str) -> Task:
        """The Task a row names, imported by its path as the worker does (load_task)."""
        try:
            return load_task(name)
        except LookupError as exc:
            raise TaskResultDoesNotExist(f"task {task_id}: {exc}") from None


def load_task(name: str) -> Task:
    """The Django Task named by an import path; LookupError saying why not.

    Only modules of installed apps are imported: a row's task name is data, and anyone who can
    insert a row must not make a process import whatever module its environment has."""
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise LookupError(f"{name!r} is not the import path of a Django task")
    if apps.get_containing_app_config(module_name) is None:
        raise LookupError(
            f"module {module_name!r} is in no installed app; Django tasks are imported only "
            "from the apps of INSTALLED_APPS"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the module raised at its import
        raise LookupError(
            f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    task = getattr(module, attr, None)
    if not isinstance(task, Task):
        raise LookupError(f"{name!r} is not a Django task (decorate it with @task)")
    try:
        backend = task_backends[task.backend]
    except Exception as exc:
        raise LookupError(f"{name!r} names task backend {task.backend!r}: {exc}") from None
    if not isinstance(backend, WorkerBackend):
        raise LookupError(
            f"{name!r} belongs to task backend {task.backend!r}, a "
            f"{type(backend).__name__}, not a WorkerBackend"
        )
    return task
