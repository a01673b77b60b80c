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


class Cancelled(WorkerError):
    """Raised by ``ctx.check()`` in a handler whose task someone asked to cancel.

    Let it propagate: the task ends ``cancelled`` (a transactional handler's writes roll back).
    Catching it changes nothing in the database: a task with a cancel request ends cancelled
    whatever its handler does, and is never recorded done.
    """
