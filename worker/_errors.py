"""Exceptions. Those a user catches or raises are re-exported from ``worker``."""

from __future__ import annotations


class WorkerError(Exception):
    """Base class for errors raised by this package."""


class ConfigError(WorkerError):
    """Configuration the worker cannot run with; the CLI prints it as one line and exits 2."""


class SchemaMissing(ConfigError):
    """The queue's tables are not in the database (run ``worker migrate``)."""


class DoNotRetry(Exception):
    """Raise from a handler to fail the task at once, whatever attempts it has left.

    Use it for input that will never work (a payload that fails validation, a deleted record):
    retrying would only delay the failure and waste the attempts.
    """


class LostLease(WorkerError):
    """The worker no longer owns a task: its lease expired and the row was rescued."""


class PayloadError(WorkerError, ValueError):
    """A payload does not fit its task's model (``@task(payload=Model)``): raised by ``enqueue``
    at the call site; a worker fails such a row at once, without retrying it."""
