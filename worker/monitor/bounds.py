"""Limits on what the monitor shows, whatever a producer writes into the tables.

Producers can write any row with plain SQL: a task name of megabytes, twenty thousand queue
names, control characters. The page and /metrics must stay small all the same, so every name is
cut to a bounded length (with a visible marker), and only a bounded set of queues gets series of
its own: the queues live workers serve plus the largest few; every other queue is summed under
``queue="(other)"``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ..ops.status import MissingHandler

NAME_CHARS = 200  # names (queues, tasks, hosts, table cells) on the page
ERROR_CHARS = 2000  # a task's last error on the page (first line and the rest together)
LABEL_CHARS = 120  # a queue name as a Prometheus label value
TOP_QUEUES = 50  # queues exported individually besides the ones live workers serve
TOP_TASKS = 20  # tasks without a live handler exported individually
QUEUES_PER_PAGE = 100  # rows of the status page's queue table
ROWS_SHOWN = 100  # rows of the page's other tables (workers, cron, locks)
OTHER = "(other)"

# C0 controls but newline and tab, DEL and C1 controls: shown as \xNN, never passed on raw (an ESC
# would reach the terminal of whoever curls the page).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def clip(value: object, limit: int = NAME_CHARS, *, length: int | None = None) -> str:
    """``value`` as text of at most about ``limit`` characters, control characters made visible,
    and a marker saying how much was cut. ``length`` is the full length when the text was already
    cut (by the SQL that read it)."""
    text = "" if value is None else str(value)
    shown = text[:limit]
    hidden = max(len(text), length or 0) - len(shown)
    if hidden > 0:
        text = f"{shown}… [{hidden:,} more characters]"
    return _CONTROL.sub(_visible, text)


def label(name: str) -> str:
    """A queue name as a label value: short, printable, and still unique (a long name keeps a
    digest of the whole, so two names that share their first characters stay two series)."""
    text = _CONTROL.sub(_visible, name)
    if len(text) <= LABEL_CHARS:
        return text
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{text[: LABEL_CHARS - 16]}…{digest}"


@dataclass(frozen=True)
class QueueRow:
    """One queue's numbers. queued and delayed (scheduled) are exact up to the counting cap;
    a count that reached it (``capped``, and per state ``capped_states``) shows the planner's
    estimate instead when that is larger (the states in ``estimated``), else the cap."""

    queue: str
    queued: int
    delayed: int
    running: int
    capped: bool
    oldest_seconds: float | None
    served: bool = False  # a live worker lists it in its queues
    waiting: int = 0  # tasks that could run now (queued, and scheduled ones already due)
    failed: int = 0
    capped_states: frozenset[str] = frozenset()
    estimated: frozenset[str] = frozenset()

    @property
    def unserved(self) -> int:
        """Tasks waiting for a worker that serves this queue, when no live worker does."""
        return 0 if self.served else self.waiting


@dataclass(frozen=True)
class Exported:
    """The queues /metrics exports one by one, and the sum of all the others."""

    queues: list[QueueRow]
    other: QueueRow
    other_count: int  # queues summed under OTHER (those past the scan limit not included)


def add(a: QueueRow, b: QueueRow) -> QueueRow:
    oldest = max((x for x in (a.oldest_seconds, b.oldest_seconds) if x is not None), default=None)
    return QueueRow(
        a.queue,
        a.queued + b.queued,
        a.delayed + b.delayed,
        a.running + b.running,
        a.capped or b.capped,
        oldest,
        False,  # a sum is nobody's queue; what no live worker serves is summed in waiting
        a.unserved + b.unserved,
        a.failed + b.failed,
        a.capped_states | b.capped_states,
        a.estimated | b.estimated,
    )


def exported(queues: list[QueueRow], rest: QueueRow | None, top: int = TOP_QUEUES) -> Exported:
    """Served queues always, then the ``top`` others: first those with tasks waiting that no live
    worker serves, then the largest (queued plus running, ties by name); the others and ``rest``
    (the queues past the scan limit, already summed) go under OTHER. A queue that a producer named
    OTHER is always summed there, so the label stays one series."""
    served = [q for q in queues if q.served and q.queue != OTHER]
    others = sorted(
        (q for q in queues if not q.served or q.queue == OTHER),
        key=lambda q: (q.unserved == 0, -(q.queued + q.running), q.queue),
    )
    largest = [q for q in others if q.queue != OTHER][:top]
    keep = {q.queue for q in largest}
    total = QueueRow(OTHER, 0, 0, 0, False, None)
    count = 0
    for q in others:
        if q.queue not in keep:
            total = add(total, q)
            count += 1
    if rest is not None:
        total = add(total, rest)
    shown = sorted(served + largest, key=lambda q: q.queue)
    return Exported(shown, replace(total, served=False), count)


def without_handler(
    missing: Iterable[MissingHandler], top: int = TOP_TASKS
) -> list[tuple[str, int]]:
    """(label, rows) per task that no live worker has a handler for: the ``top`` with the most
    rows, the rest summed under OTHER (a producer can write any number of task names)."""
    per_task: dict[str, int] = {}
    for m in missing:
        per_task[m.task] = per_task.get(m.task, 0) + m.count
    ranked = sorted(per_task.items(), key=lambda kv: (-kv[1], kv[0]))
    out: dict[str, int] = {}
    for i, (task, n) in enumerate(ranked):
        key = label(task) if i < top and task != OTHER else OTHER
        out[key] = out.get(key, 0) + n
    return sorted(out.items())


__all__ = [
    "ERROR_CHARS",
    "NAME_CHARS",
    "OTHER",
    "QUEUES_PER_PAGE",
    "ROWS_SHOWN",
    "TOP_QUEUES",
    "TOP_TASKS",
    "Exported",
    "QueueRow",
    "clip",
    "exported",
    "label",
    "without_handler",
]
