"""worker: a PostgreSQL work queue for Python.

The public API is what this module exports; everything in underscore modules is private.
Importing it loads none of the queue: each name below loads its module when first used, so
``import worker`` is cheap and the ``worker`` command starts without loading what it does not
run (the engine for ``worker status``, the console for ``worker enqueue``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .coord.advisory import AdvisoryLock, advisory_keys, advisory_lock
    from .coord.cancel import Cancellation, cancel
    from .coord.exclusive import current_lock, exclusive
    from .coord.locks import ExclusiveLock, LockLost, Mutex, TimeoutLock
    from .coord.pause import PausedQueue, pause_queue, paused_queues, resume_queue
    from .coord.schedule import cron, load_schedules, schedule
    from .db.migrate import migrate
    from .engine.background import BackgroundWorker
    from .engine.loop import Worker, WorkerConfig
    from .errors import (
        Cancelled,
        ConfigError,
        DoNotRetry,
        LostLease,
        PayloadError,
        ResultError,
        ResultNotSerializable,
        ResultTooLarge,
        SchemaMissing,
        TaskCancelled,
        TaskFailed,
        TaskNotFound,
        WaitTimeout,
        WorkerError,
    )
    from .tasks.enqueue import enqueue, enqueue_async, enqueue_many
    from .tasks.flows import EnqueuedWorkflow, enqueue_workflow
    from .tasks.limits import (
        Limits,
        QueueLimits,
        clear_queue_limits,
        queue_limits,
        set_queue_limits,
    )
    from .tasks.registry import Context, Registry, TaskDef, limit, registry, task
    from .tasks.wait import wait, wait_async
    from .tasks.waiter import Waiter
    from .tasks.workflow import After, Step, Workflow, WorkflowError, after, chain, group, step

__all__ = [
    "AdvisoryLock",
    "After",
    "BackgroundWorker",
    "Cancellation",
    "Cancelled",
    "ConfigError",
    "Context",
    "DoNotRetry",
    "EnqueuedWorkflow",
    "ExclusiveLock",
    "Limits",
    "LockLost",
    "LostLease",
    "Mutex",
    "PausedQueue",
    "PayloadError",
    "QueueLimits",
    "Registry",
    "ResultError",
    "ResultNotSerializable",
    "ResultTooLarge",
    "SchemaMissing",
    "Step",
    "TaskCancelled",
    "TaskDef",
    "TaskFailed",
    "TaskNotFound",
    "TimeoutLock",
    "WaitTimeout",
    "Waiter",
    "Worker",
    "WorkerConfig",
    "WorkerError",
    "Workflow",
    "WorkflowError",
    "advisory_keys",
    "advisory_lock",
    "after",
    "cancel",
    "chain",
    "clear_queue_limits",
    "cron",
    "current_lock",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_workflow",
    "exclusive",
    "group",
    "limit",
    "load_schedules",
    "migrate",
    "pause_queue",
    "paused_queues",
    "queue_limits",
    "registry",
    "resume_queue",
    "schedule",
    "set_queue_limits",
    "step",
    "task",
    "wait",
    "wait_async",
]

# The module of each name above (the same list, for the first use of a name at run time).
_HOME: dict[str, str] = {
    "advisory_keys": ".coord.advisory",
    "advisory_lock": ".coord.advisory",
    "AdvisoryLock": ".coord.advisory",
    "After": ".tasks.workflow",
    "after": ".tasks.workflow",
    "BackgroundWorker": ".engine.background",
    "cancel": ".coord.cancel",
    "Cancellation": ".coord.cancel",
    "Cancelled": ".errors",
    "chain": ".tasks.workflow",
    "clear_queue_limits": ".tasks.limits",
    "ConfigError": ".errors",
    "Context": ".tasks.registry",
    "cron": ".coord.schedule",
    "current_lock": ".coord.exclusive",
    "DoNotRetry": ".errors",
    "enqueue": ".tasks.enqueue",
    "enqueue_async": ".tasks.enqueue",
    "enqueue_many": ".tasks.enqueue",
    "enqueue_workflow": ".tasks.flows",
    "EnqueuedWorkflow": ".tasks.flows",
    "exclusive": ".coord.exclusive",
    "ExclusiveLock": ".coord.locks",
    "group": ".tasks.workflow",
    "limit": ".tasks.registry",
    "Limits": ".tasks.limits",
    "load_schedules": ".coord.schedule",
    "LockLost": ".coord.locks",
    "LostLease": ".errors",
    "migrate": ".db.migrate",
    "Mutex": ".coord.locks",
    "pause_queue": ".coord.pause",
    "paused_queues": ".coord.pause",
    "PausedQueue": ".coord.pause",
    "PayloadError": ".errors",
    "queue_limits": ".tasks.limits",
    "QueueLimits": ".tasks.limits",
    "Registry": ".tasks.registry",
    "registry": ".tasks.registry",
    "ResultError": ".errors",
    "ResultNotSerializable": ".errors",
    "ResultTooLarge": ".errors",
    "resume_queue": ".coord.pause",
    "schedule": ".coord.schedule",
    "SchemaMissing": ".errors",
    "set_queue_limits": ".tasks.limits",
    "Step": ".tasks.workflow",
    "step": ".tasks.workflow",
    "task": ".tasks.registry",
    "TaskCancelled": ".errors",
    "TaskDef": ".tasks.registry",
    "TaskFailed": ".errors",
    "TaskNotFound": ".errors",
    "TimeoutLock": ".coord.locks",
    "wait": ".tasks.wait",
    "wait_async": ".tasks.wait",
    "Waiter": ".tasks.waiter",
    "WaitTimeout": ".errors",
    "Worker": ".engine.loop",
    "WorkerConfig": ".engine.loop",
    "WorkerError": ".errors",
    "Workflow": ".tasks.workflow",
    "WorkflowError": ".tasks.workflow",
}


def __getattr__(name: str) -> Any:
    """Load a public name's module on its first use, and keep the name here after that."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
