"""Task handlers: the ``@task`` decorator and the registry a worker looks names up in."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import Cancelled
from .limits import Limits
from .payload import check_model

if TYPE_CHECKING:
    import psycopg

DEFAULT_QUEUE = "default"
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_BACKOFF = 2.0


class CancelSignal(Protocol):
    """Whatever tells a context that its task was asked to stop (the worker's job): someone
    cancelled the task, or the worker is stopping."""

    cancel_requested: bool
    stop_requested: bool


@dataclass
class Context:
    """What a handler may want besides its payload.

    ``conn`` is set only for handlers registered with ``transactional=True``: it is the
    connection whose open transaction will also mark the task done, so the handler's writes and
    the completion commit together or not at all.

    ``inputs`` is a workflow step's view of the steps it depends on: their results, in the order
    its ``depends_on`` names them (a chain's step gets ``[previous result]``; a group's join step
    the group's results in order).

    ``cancelled`` turns true when someone asks to cancel the task while it runs (``worker
    cancel``, ``worker.cancel()``, ``SELECT worker.cancel_task(...)``, the console), and when
    the worker begins a graceful stop; ``check()`` then raises ``worker.Cancelled``. A sync
    handler that runs for long should call ``check()`` between steps; an ``async`` one is
    cancelled by the worker itself at a cancel request. A handler that stops this way during a
    graceful stop gives its task back to the queue, its attempt not counted; at a cancel
    request the task ends cancelled.
    """

    task_id: int
    task: str
    queue: str
    attempt: int
    max_attempts: int
    worker_id: str
    conn: psycopg.Connection | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    cancel_signal: CancelSignal | None = field(default=None, repr=False, compare=False)
    # A workflow's step: the results of the steps it depends on, in the order they were declared
    # (None for a step that failed but whose edge said run_on_failure), and the workflow's id.
    # An empty list and None for a task outside any workflow.
    inputs: list[Any] = field(default_factory=list)
    workflow_id: int | None = None

    @property
    def cancelled(self) -> bool:
        """Whether someone asked to cancel this task, or its worker is stopping (read from the
        worker, no database trip)."""
        sig = self.cancel_signal
        return sig is not None and (sig.cancel_requested or sig.stop_requested)

    def check(self) -> None:
        """Raise ``worker.Cancelled`` if someone asked to cancel this task or its worker is
        stopping; else do nothing."""
        sig = self.cancel_signal
        if sig is not None and sig.cancel_requested:
            raise Cancelled(f"task {self.task_id} was cancelled while it ran")
        if sig is not None and sig.stop_requested:
            raise Cancelled(f"task {self.task_id} was stopped: its worker is stopping")


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
    # Store the handler's return value with its row (see tasks.results); None: as the worker says
    # (WorkerConfig.store_results, off by default).
    store_result: bool | None = None
    payload: type | None = None  # a dataclass or pydantic model: see tasks.payload
    # Per-key limits (see tasks.limits): a payload field name or a function of the payload, applied
    # by the producer when it enqueues (Python); SQL producers write tasks.limit_key.
    limit_key: str | Callable[[Any], Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the decorated name calls the plain function, which keeps handlers testable."""
        return getattr(self.fn, "handler", self.fn)(*args, **kwargs)


def _wants_context(fn: Callable[..., Any]) -> bool:
    """A handler is called ``fn(payload)`` or ``fn(payload, ctx)``; decide once, at registration.

    Any callable that can take the payload positionally is accepted, ``*args`` included (what a
    decorator without ``functools.wraps`` leaves); it gets the context too when it can take a
    second positional argument (a second parameter, or ``*args``)."""
    inner = _hidden_function(fn)
    if inner is not None:
        # A decorator without functools.wraps: its (*args, **kwargs) says nothing, but the one
        # function it closes over does. Decide by that one, or a wrapped `def h(payload)` would
        # be handed a context it cannot take, and fail on every run.
        return _wants_context(inner)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: give it the payload only
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    missing_kw = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    name = getattr(fn, "__qualname__", repr(fn))
    if not positional and not varargs:
        raise TypeError(f"handler {name} must accept the payload as first argument")
    if len(required) > 2:
        raise TypeError(f"handler {name} needs {len(required)} arguments; it gets (payload, ctx)")
    if missing_kw:
        raise TypeError(f"handler {name} has required keyword-only arguments {missing_kw}")
    return varargs or len(positional) >= 2


def _hidden_function(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The function a ``*args`` wrapper closes over, when there is exactly one."""
    if not _opaque(fn):
        return None
    cells = getattr(fn, "__closure__", None) or ()
    found = []
    for cell in cells:
        with contextlib.suppress(ValueError):  # an empty cell
            if inspect.isfunction(cell.cell_contents) or inspect.ismethod(cell.cell_contents):
                found.append(cell.cell_contents)
    return found[0] if len(found) == 1 and found[0] is not fn else None


def _opaque(fn: Callable[..., Any]) -> bool:
    """Whether the signature hides the handler (``*args``): a decorator without functools.wraps."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_POSITIONAL for p in params)


def _awaiting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run to completion: a wrapper that hides an ``async def`` returns a coroutine, which
    would otherwise be dropped unawaited and the task counted done without having run."""

    def call(*args: Any) -> Any:
        result = fn(*args)
        if inspect.isawaitable(result):
            return asyncio.run(_wait(result))
        return result

    call.__qualname__ = getattr(fn, "__qualname__", repr(fn))
    call.handler = fn  # type: ignore[attr-defined]
    return call


async def _wait(awaitable: Any) -> Any:
    return await awaitable


class Registry:
    def __init__(self) -> None:
        self._tasks: dict[str, TaskDef] = {}
        self.limits: dict[str, Limits] = {}  # declared per queue (see limit)

    def limit(
        self,
        queue: str,
        *,
        concurrency: int | None = None,
        key_concurrency: int | None = None,
        rate: str | tuple[int, float] | None = None,
        key_rate: str | tuple[int, float] | None = None,
        burst: int | None = None,
        key_burst: int | None = None,
    ) -> Limits:
        """Declare ``queue``'s fleet-wide limits (see tasks.limits.Limits); a worker serving the
        queue records them when it starts, unless an operator has set the queue's limits."""
        if not queue:
            raise ValueError("queue must not be empty")
        limits = Limits.of(
            concurrency=concurrency,
            key_concurrency=key_concurrency,
            rate=rate,
            key_rate=key_rate,
            burst=burst,
            key_burst=key_burst,
        )
        self.limits[queue] = limits
        return limits

    def task(
        self,
        name: str | None = None,
        *,
        queue: str = DEFAULT_QUEUE,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_backoff: float = DEFAULT_BACKOFF,
        timeout: float | None = None,
        transactional: bool = False,
        store_result: bool | None = None,
        payload: type | None = None,
        limit_key: str | Callable[[Any], Any] | None = None,
        limits: Limits | None = None,
    ) -> Callable[[Callable[..., Any]], TaskDef]:
        if payload is not None:
            check_model(payload)
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
            wants_context = transactional or _wants_context(fn)
            run = _awaiting(fn) if not is_async and _opaque(fn) else fn
            definition = TaskDef(
                name=task_name,
                fn=run,
                queue=queue,
                max_attempts=max_attempts,
                retry_backoff=retry_backoff,
                timeout=timeout,
                transactional=transactional,
                is_async=is_async,
                wants_context=wants_context,
                store_result=store_result,
                payload=payload,
                limit_key=limit_key,
            )
            existing = self._tasks.get(task_name)
            if existing is not None and getattr(existing.fn, "handler", existing.fn) is not fn:
                raise ValueError(f"task {task_name!r} is already registered")
            self._tasks[task_name] = definition
            if limits is not None:
                if limits.empty:
                    raise ValueError("limits: give at least one limit")
                self.limits[queue] = limits
            return definition

        return decorate

    def get(self, name: str) -> TaskDef | None:
        return self._tasks.get(name)

    def why_missing(self, name: str) -> str | None:
        """Why ``get(name)`` found nothing, when there is more to say than "not registered": a
        registry that loads handlers on demand (worker.contrib.django) says what failed."""
        return None

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def queues(self) -> list[str]:
        return sorted({t.queue for t in self._tasks.values()})

    def __len__(self) -> int:
        return len(self._tasks)


registry = Registry()
task = registry.task
limit = registry.limit
