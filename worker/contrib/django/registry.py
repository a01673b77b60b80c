"""How a worker finds a Django task: by the import path that is its name.

A producer and a worker share nothing but the database, so the worker cannot know in advance
which Django tasks it will meet. ``DjangoRegistry`` is a ``worker.Registry`` that, asked for a
name it does not know, imports it (``shop.tasks.send_receipt``: module ``shop.tasks``, attribute
``send_receipt``) and, if that is a Django ``Task`` whose backend is a ``WorkerBackend``, registers
a handler for it. What cannot be imported, or is something else, is not run: the worker hands the
row back uncounted for a worker that has it (as for any unknown task, e.g. during a rolling
deploy), and the row's ``last_error`` says why (``why_missing``), e.g. ``cannot import module
'shop.tasks' (No module named 'shop')``.

Each run calls the task the way Django's own backends do (``Task.call``, a ``TaskContext`` first
for ``takes_context`` tasks), sends Django's ``task_started`` and ``task_finished`` signals, and
closes the runner thread's stale Django connections before and after (as Django does around a
request), so a task's ORM queries never use a connection that went away.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections
from django.utils import timezone

from worker import Context, DoNotRetry, Registry, TaskDef

from .backend import WorkerBackend, arguments, load_task
from .compat import Task, TaskContext, TaskResult, TaskResultStatus, task_finished, task_started


class DjangoRegistry(Registry):
    """A registry that loads Django tasks on demand, by their import path."""

    def __init__(self) -> None:
        super().__init__()
        self._missing: dict[str, str] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> TaskDef | None:
        found = super().get(name)
        if found is not None or name in self._missing:
            return found
        with self._lock:
            found = super().get(name)
            if found is None and name not in self._missing:
                found = self._load(name)
        return found

    def why_missing(self, name: str) -> str | None:
        return self._missing.get(name)

    def _load(self, name: str) -> TaskDef | None:
        try:
            task = load_task(name)
        except LookupError as exc:
            # Remembered: a module that failed to import is not imported again for every row.
            self._missing[name] = str(exc)
            return None
        self._tasks[name] = definition = TaskDef(
            name=name,
            fn=handler(task),
            queue=task.queue_name,
            max_attempts=1,  # the producer's MAX_ATTEMPTS is in each row
            wants_context=True,
            # Django reads return values back through get_result(): always stored.
            store_result=True,
        )
        return definition


def handler(task: Task) -> Callable[[Any, Context], Any]:
    def run(payload: Any, ctx: Context) -> Any:
        try:
            args, kwargs = arguments(payload)
        except ValueError as exc:
            raise DoNotRetry(str(exc)) from None
        result = running_result(task, ctx, args, kwargs)
        close_old_connections()
        task_started.send(WorkerBackend, task_result=result)
        try:
            if task.takes_context:
                value = task.call(TaskContext(task_result=result), *args, **kwargs)
            else:
                value = task.call(*args, **kwargs)
        except BaseException:
            _finished(result, TaskResultStatus.FAILED)
            raise
        finally:
            close_old_connections()
        _finished(result, TaskResultStatus.SUCCESSFUL, value)
        return value

    run.__qualname__ = task.module_path
    return run


def running_result(task: Task, ctx: Context, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The TaskResult a running task sees in its TaskContext."""
    now = timezone.now()
    return TaskResult(
        task=task,
        id=str(ctx.task_id),
        status=TaskResultStatus.RUNNING,
        enqueued_at=None,
        started_at=now,
        last_attempted_at=now,
        finished_at=None,
        args=args,
        kwargs=kwargs,
        backend=task.backend,
        errors=[],
        worker_ids=[ctx.worker_id] * ctx.attempt,
    )


def _finished(result: Any, status: Any, value: Any = None) -> None:
    object.__setattr__(result, "status", status)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    # Sent inside the except clause for a failure, so that Django's logger records the exception.
    task_finished.send(WorkerBackend, task_result=result)
