"""Exceptions. Those a user catches or raises are re-exported from ``worker``."""

from __future__ import annotations


class WorkerError(Exception):
    """Base class for errors raised by this package."""


class ConfigError(WorkerError):
    """Configuration the worker cannot run with; the CLI prints it as one line and exits 2."""


class SchemaMissing(ConfigError):
    """The queue's tables are not in the database, or not at the version this code needs. Its
    text is one line naming the command that fixes it (``worker migrate --schema NAME``, or
    ``python manage.py migrate`` under Django).

    ``schema`` is the schema's name, ``version`` the version found (0: no worker tables; None:
    not known) and ``needed`` the version this code needs, when the raiser knew them.
    """

    def __init__(
        self,
        message: str,
        *,
        schema: str | None = None,
        version: int | None = None,
        needed: int | None = None,
    ) -> None:
        super().__init__(message)
        self.schema = schema
        self.version = version
        self.needed = needed


class DoNotRetry(Exception):
    """Raise from a handler to fail the task at once, whatever attempts it has left.

    Use it for input that will never work (a payload that fails validation, a deleted record):
    retrying would only delay the failure and waste the attempts.
    """


class LostLease(WorkerError):
    """The worker no longer owns a task: its lease expired and the row was rescued."""


class Cancelled(WorkerError):
    """Raised by ``ctx.check()`` in a handler whose task someone asked to cancel.

    Let it propagate: the task ends ``cancelled`` (a transactional handler's writes roll back).
    Catching it changes nothing in the database: a task with a cancel request ends cancelled
    whatever its handler does, and is never recorded done.
    """


class ResultError(DoNotRetry, WorkerError):
    """A handler's return value cannot be stored (see ``store_result``). The task fails at once:
    the same handler would return the same value on every attempt."""


class ResultTooLarge(ResultError):
    """The result's JSON is over the size limit (``max_result_bytes``, ``--max-result-size``)."""


class ResultNotSerializable(ResultError):
    """The result is not JSON a PostgreSQL ``jsonb`` column can hold."""


class TaskFailed(WorkerError):
    """The task a waiter waited on failed for good; ``error`` is its last error."""

    def __init__(self, task_id: int, error: str | None) -> None:
        first = (error or "").strip().splitlines()[0] if (error or "").strip() else "no error text"
        super().__init__(f"task {task_id} failed: {first}")
        self.task_id = task_id
        self.error = error


class TaskCancelled(WorkerError):
    """The task a waiter waited on was cancelled."""

    def __init__(self, task_id: int) -> None:
        super().__init__(f"task {task_id} was cancelled")
        self.task_id = task_id


class TaskNotFound(WorkerError, LookupError):
    """No such task: it never existed, or its row is gone (purged, deleted on completion with
    ``--keep-done 0``, or deleted by an operator)."""

    def __init__(self, task_id: int) -> None:
        super().__init__(
            f"task {task_id} does not exist (never enqueued, or its row was deleted: purged, "
            "completed under --keep-done 0, or deleted by an operator)"
        )
        self.task_id = task_id


class WaitTimeout(WorkerError, TimeoutError):
    """The task did not finish within the waiter's timeout (it may still finish later)."""

    def __init__(self, task_id: int, timeout: float) -> None:
        super().__init__(f"task {task_id} did not finish within {timeout:g}s")
        self.task_id = task_id
        self.timeout = timeout


class PayloadError(WorkerError, ValueError):
    """A payload does not fit its task's model (``@task(payload=Model)``): raised by ``enqueue``
    at the call site; a worker fails such a row at once, without retrying it."""
