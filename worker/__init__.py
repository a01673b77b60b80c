"""worker: a PostgreSQL work queue for Python.

The public API is what this module exports; everything in underscore modules is private.
Importing it loads the queue's core only: the CLI (``worker.cli``), the monitor
(``worker.monitor``) and the developer tools (``worker.dev``) load when used.
"""

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
from .tasks.limits import Limits, QueueLimits, clear_queue_limits, queue_limits, set_queue_limits
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
