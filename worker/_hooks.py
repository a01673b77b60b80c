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
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._registry import TaskDef
    from ._transitions import Claimed


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
