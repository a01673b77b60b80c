"""Task handlers: the ``@task`` decorator and the registry a worker looks names up in."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

DEFAULT_QUEUE = "default"
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_BACKOFF = 2.0


@dataclass
class Context:
    """What a handler may want besides its payload.

    ``conn`` is set only for handlers registered with ``transactional=True``: it is the
    connection whose open transaction will also mark the task done, so the handler's writes and
    the completion commit together or not at all.
    """

    task_id: int
    task: str
    queue: str
    attempt: int
    max_attempts: int
    worker_id: str
    conn: psycopg.Connection | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskDef:
    name: str
    fn: Callable[..., Any]
    queue: str = DEFAULT_QUEUE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry_backoff: float = DEFAULT_BACKOFF
    timeout: float | None = None
    transactional: bool = False
    is_async: bool = False
    wants_context: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the decorated name calls the plain function, which keeps handlers testable."""
        return self.fn(*args, **kwargs)


def _wants_context(fn: Callable[..., Any]) -> bool:
    """A handler takes ``(payload)`` or ``(payload, ctx)``; decide once, at registration."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if not params:
        raise TypeError(f"handler {fn.__qualname__} must accept the payload as first argument")
    return len(params) >= 2


class Registry:
    def __init__(self) -> None:
        self._tasks: dict[str, TaskDef] = {}

    def task(
        self,
        name: str | None = None,
        *,
        queue: str = DEFAULT_QUEUE,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_backoff: float = DEFAULT_BACKOFF,
        timeout: float | None = None,
        transactional: bool = False,
    ) -> Callable[[Callable[..., Any]], TaskDef]:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if retry_backoff < 0:
            raise ValueError("retry_backoff must not be negative")
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be positive")

        def decorate(fn: Callable[..., Any]) -> TaskDef:
            task_name = name or f"{fn.__module__}.{fn.__qualname__}"
            if not task_name or not queue:
                raise ValueError("task name and queue must not be empty")
            is_async = inspect.iscoroutinefunction(fn)
            if transactional and is_async:
                raise ValueError("transactional handlers must be plain functions (sync connection)")
            definition = TaskDef(
                name=task_name,
                fn=fn,
                queue=queue,
                max_attempts=max_attempts,
                retry_backoff=retry_backoff,
                timeout=timeout,
                transactional=transactional,
                is_async=is_async,
                wants_context=transactional or _wants_context(fn),
            )
            existing = self._tasks.get(task_name)
            if existing is not None and existing.fn is not fn:
                raise ValueError(f"task {task_name!r} is already registered")
            self._tasks[task_name] = definition
            return definition

        return decorate

    def get(self, name: str) -> TaskDef | None:
        return self._tasks.get(name)

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def queues(self) -> list[str]:
        return sorted({t.queue for t in self._tasks.values()})

    def __len__(self) -> int:
        return len(self._tasks)


registry = Registry()
task = registry.task
