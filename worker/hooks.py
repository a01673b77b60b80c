"""Observation points of a worker. Metrics subclass this; the default does nothing.

The worker calls these on its main thread (``finished`` and ``acked`` included), once per batch
where the event is per batch, so an observer adds no locking to the hot path.

Events that a database transaction makes true (``claimed``, ``acked``, ``rescued``) are reported
inside that transaction, between ``begin`` and ``commit``/``rollback``, with ``prepare`` called
last before COMMIT. An observer that must count exactly what the database committed, even when
its process is killed at the worst moment, buffers them and acts in those three calls (see
``_metrics``); the default observer ignores them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .engine.job import Job, Outcome
    from .store import Claimed
    from .tasks.registry import TaskDef

log = logging.getLogger("worker")


class Hooks:
    def started(self, worker: Any) -> None:
        pass

    def begin(self) -> None:
        """A transaction starts; its events follow."""

    def prepare(self, worker: Any, conn: Any) -> None:
        """Its statements succeeded; COMMIT is next. May run a statement in the transaction."""

    def commit(self) -> None:
        """It committed: its events are facts now."""

    def rollback(self) -> None:
        """It failed: forget its events (the rows they describe did not change)."""

    def stopped(self, worker: Any) -> None:
        pass

    def claimed(self, worker: Any, rows: list[Claimed]) -> None:
        pass

    def finished(
        self, worker: Any, definition: TaskDef, row: Claimed, ok: bool, seconds: float
    ) -> None:
        pass

    def acked(self, worker: Any, kind: str, ids: Iterable[Any] | Mapping[int, str]) -> None:
        """kind "done": ids completed; kind "failed": {id: "queued" | "scheduled" | "failed" |
        "handed_back"}; kind "cancelled": ids that ended cancelled (a cancel request, schema/0010)
        instead of done or retried."""

    def lost(self, worker: Any, row: Claimed) -> None:
        pass

    def rescued(self, worker: Any, rows: list[tuple[int, str, str, str]]) -> None:
        pass

    def db_error(self, worker: Any, exc: BaseException) -> None:
        pass

    def cron_enqueued(self, worker: Any, count: int) -> None:
        pass


# -- events from code that runs outside a worker (locks, cron helpers used from a web app) --------
#
# Metrics subscribe here; emitting costs one list walk and nothing when no one listens.

_listeners: list[Callable[..., None]] = []


def subscribe(listener: Callable[..., None]) -> None:
    if listener not in _listeners:
        _listeners.append(listener)


def emit(event: str, **fields: Any) -> None:
    """Tell subscribers that ``event`` happened, e.g. ``emit("lock", kind="exclusive", won=True)``.

    A failing listener must never break the code that emits, so errors are swallowed.
    """
    for listener in list(_listeners):
        with contextlib.suppress(Exception):
            listener(event, **fields)


# -- tracing: a producer's context carried with its row, an observer around each run -------------
#
# The core knows no tracing library. It keeps two lists that an integration (worker.contrib.otel)
# fills, and consults each with one truth test: a process that registers nothing builds no
# object and makes no call per enqueue or per run.


@dataclass(slots=True)
class Send:
    """One enqueue call (``batch``: enqueue_many, or enqueue_workflow when ``workflow`` is set)
    as a producer observer sees it.

    On entering its context an observer may add entries to ``carrier`` (for OpenTelemetry, the
    W3C ``traceparent``/``tracestate``): they are stored with the row(s) as JSON (column
    ``trace_context``, schema/0013; a workflow's steps all carry the same). On leaving it reads
    what the call came to: the task id (single enqueue), how many rows were written (``count``),
    the workflow's id, or the exception.
    """

    task: str  # "" for a workflow (its steps' tasks differ)
    queue: str | None  # None: the database routes the row (schema/0006), or a workflow's differ
    batch: bool
    carrier: dict[str, str] = field(default_factory=dict)
    task_id: int | None = None
    count: int = 0
    workflow: str | None = None  # enqueue_workflow: the workflow's name ("" for none)
    workflow_id: int | None = None  # and, on leaving, its id


class RunObserver(Protocol):
    """Told about each run of a handler, on the runner thread that runs it.

    ``start`` is called just before the handler (so a span it makes current is the parent of the
    handler's own spans) and returns a token; ``end`` gets that token, the outcome as the runner
    made it and the exception the handler raised, if any. Neither may raise into the worker: the
    executor logs and drops their errors.
    """

    def start(self, job: Job) -> Any: ...

    def end(self, token: Any, job: Job, outcome: Outcome, exc: BaseException | None) -> None: ...


producers: list[Callable[[Send], AbstractContextManager[Any]]] = []
runs: list[RunObserver] = []


@contextlib.contextmanager
def sending(send: Send) -> Iterator[Send]:
    """Enter every producer observer around one enqueue (called only when ``producers``)."""
    with contextlib.ExitStack() as stack:
        for observe in list(producers):
            stack.enter_context(observe(send))
        yield send


def start_runs(job: Job) -> list[tuple[RunObserver, Any]]:
    """Called by a runner only when ``runs`` is not empty."""
    started = []
    for observer in list(runs):
        try:
            started.append((observer, observer.start(job)))
        except Exception:
            log.exception("run observer %r failed to start", observer)
    return started


def end_runs(
    started: list[tuple[RunObserver, Any]], job: Job, outcome: Outcome, exc: BaseException | None
) -> None:
    for observer, token in reversed(started):
        try:
            observer.end(token, job, outcome, exc)
        except Exception:
            log.exception("run observer %r failed to end", observer)
