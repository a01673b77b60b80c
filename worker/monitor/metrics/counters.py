"""Prometheus metrics: what each worker process counts, and the one server per machine that
exports it.

Two kinds of numbers, from two places:

* Worker metrics (tasks claimed, completed, durations, ...) are counted inside each worker
  process by ``MetricsHooks``. Under ``worker run --processes N`` the supervisor serves them for
  all its children through prometheus-client's multiprocess mode: it creates a fresh
  ``PROMETHEUS_MULTIPROC_DIR`` before the first child starts, each child's prometheus-client finds
  the variable in its environment at import and keeps its values in files there, and the files of
  a dead child stay (so its counts survive it being replaced) while its live gauges are dropped.
* Queue gauges (depth, oldest age, ...) come from the database. Only the metrics server reads
  them, through one cached query set per cache period (see ``_web.Database``), so scraping ten
  machines costs ten cheap query sets per period, not one per scrape or per process.

Hooks run on the worker's main thread once per batch, so they aggregate per batch: a batch of a
hundred tasks of one kind costs a few counter increments, not a few hundred.

Counts a child loses to SIGKILL. A worker counts a claim or an acknowledgement after its
transaction commits, so a child killed between the COMMIT and the counting would lose those
counts. Under a supervisor each child therefore keeps a journal: before COMMIT it writes the
transaction id and the totals the transaction will bring its task counters to (one small file,
replaced atomically); when a child dies, the supervisor asks the database whether that
transaction committed and, if it did, adds whatever the dead child's counter file is short of.
The task counters (claimed, completed, retried, failed, rescued) are exact that way; histograms
and the other counters may miss the last batch of a killed child.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from ...db.sql import queries
from ...hooks import Hooks
from .instruments import (
    MULTIPROC_ENV,
    UNREGISTERED,
    _Children,
    _observe_many,
    bucket_counts,
    instruments,
)
from .journal import SQL_DIR, Journal, Sample, counter_samples, histogram_samples

if TYPE_CHECKING:
    from ...store import Claimed
    from ...tasks.registry import TaskDef

log = logging.getLogger("worker.metrics")

# -- the hooks -------------------------------------------------------------------------------------


def _current_xid(schema: str) -> Any:
    """The statement that reads the current transaction's id (metrics.sql beside this module)."""
    return queries(schema, SQL_DIR)["metrics_current_xact_id"]


class _Txn:
    """What one transaction's events will change, held until it commits or rolls back."""

    __slots__ = ("on_commit", "on_rollback", "samples", "xid")

    def __init__(self) -> None:
        self.xid = ""
        self.samples: list[tuple[Sample, float]] = []
        self.on_commit: list[Callable[[], None]] = []
        self.on_rollback: list[Callable[[], None]] = []


class MetricsHooks(Hooks):
    """Counts a worker's work. One instance per Worker; all calls come from its main thread."""

    def __init__(self) -> None:
        m = self.m = instruments()
        self._claimed = _Children(m.claimed, "worker_tasks_claimed")
        self._completed = _Children(m.completed, "worker_tasks_completed")
        self._retried = _Children(m.retried, "worker_tasks_retried")
        self._failed = _Children(m.failed, "worker_tasks_failed")
        self._rescued = _Children(m.rescued, "worker_tasks_rescued")
        self._lost = _Children(m.lost)
        self._duration = _Children(m.duration)
        self._latency = _Children(m.latency, "worker_task_latency_seconds")
        self._batch = _Children(m.batch, "worker_claim_batch_size")
        # Under a supervisor only (see monitor.metrics.journal): a process on its own loses all its
        # counts when it dies anyway.
        directory = os.environ.get(MULTIPROC_ENV)
        self._journal = Journal(directory, os.getpid()) if directory else None
        self._tx: _Txn | None = None
        # id -> (queue, task) of every row claimed and not yet acknowledged: acks carry ids only.
        self._labels: dict[int, tuple[str, str]] = {}
        self._durations: dict[tuple[str, str], list[float]] = {}
        self._limit = 1000
        self._outage = False
        self._running = False

    # lifecycle

    def started(self, worker: Any) -> None:
        cfg = getattr(worker, "config", None)
        if cfg is not None:
            # Entries left by rows lost at acknowledgement (rare) are trimmed past this size.
            self._limit = 4 * (cfg.concurrency + cfg.batch_size) + 100
        self._running = True
        self.m.processes.inc()
        self.m.in_flight.set(0)

    def stopped(self, worker: Any) -> None:
        self._flush_durations()
        self._labels.clear()
        self.m.in_flight.set(0)
        if self._running:
            self._running = False
            self.m.processes.dec()

    # transactions (see worker.hooks.Hooks.begin)

    def begin(self) -> None:
        self._tx = _Txn()

    def prepare(self, worker: Any, conn: Any) -> None:
        tx = self._tx
        if tx is None or not tx.samples or self._journal is None:
            return
        # The claim statement returns the transaction id; only acknowledgements without a claim
        # (an idle or stopping worker) pay a statement for it.
        xid = tx.xid or conn.execute(_current_xid(worker.q.schema)).fetchone()[0]
        try:
            self._journal.write(xid, tx.samples)
        except OSError as exc:
            # Metrics must never stop the work: count on, without the guarantee across kills.
            log.warning("metrics journal unavailable (%s); counts may miss killed batches", exc)
            self._journal = None

    def commit(self) -> None:
        tx, self._tx = self._tx, None
        if tx is None:
            return
        for action in tx.on_commit:
            action()
        if self._journal is not None:
            self._journal.add(tx.samples)
        self.m.in_flight.set(len(self._labels))

    def rollback(self) -> None:
        tx, self._tx = self._tx, None
        if tx is None:
            return
        for action in reversed(tx.on_rollback):
            action()
        self.m.in_flight.set(len(self._labels))

    def _count(self, action: Callable[[], None], samples: list[tuple[Sample, float]]) -> None:
        """Apply ``action`` now, or when the open transaction commits; ``samples`` say what it
        adds to the journaled metrics."""
        if self._tx is not None:
            self._tx.on_commit.append(action)
            self._tx.samples.extend(samples)
            return
        action()
        if self._journal is not None:
            self._journal.add(samples)

    def _inc(self, children: _Children, key: tuple[str, ...], n: float) -> None:
        samples = counter_samples(children.name, key, n) if self._journal is not None else []
        self._count(partial(children(key).inc, n), samples)

    def _observe(self, children: _Children, key: tuple[str, ...], values: list[float]) -> None:
        child = children(key)
        bounds = getattr(child, "_upper_bounds", None)
        if self._journal is None or bounds is None:
            self._count(partial(_observe_many, child, values), [])
            return
        # Bucketed once, for the journal and for the histogram alike.
        counts = bucket_counts(bounds, values)
        samples = histogram_samples(children.name, key, bounds, counts, sum(values))
        self._count(partial(_observe_many, child, values, counts), samples)

    # the hot path

    def claimed(self, worker: Any, rows: list[Claimed]) -> None:
        if not rows:
            return
        self._recovered()
        labels = self._labels
        known = worker.registry.get
        latencies: dict[tuple[str, str], list[float]] = {}
        for r in rows:
            key = (r.queue, r.task if known(r.task) is not None else UNREGISTERED)
            labels[r.id] = key
            due = r.run_at if r.run_at > r.created_at else r.created_at
            wait = (r.claimed_at - due).total_seconds()
            bucket = latencies.get(key)
            if bucket is None:
                latencies[key] = [wait if wait > 0 else 0.0]
            else:
                bucket.append(wait if wait > 0 else 0.0)
        for key, values in latencies.items():
            self._inc(self._claimed, key, len(values))
            self._observe(self._latency, key, values)
        self._observe(self._batch, (rows[0].queue,), [float(len(rows))])
        if self._tx is not None:
            self._tx.xid = self._tx.xid or rows[0].xid

            def forget() -> None:  # the claim rolled back: these rows are not ours
                for r in rows:
                    labels.pop(r.id, None)

            self._tx.on_rollback.append(forget)
        if len(labels) > self._limit:
            self._trim()
        self.m.in_flight.set(len(labels))

    def finished(
        self, worker: Any, definition: TaskDef, row: Claimed, ok: bool, seconds: float
    ) -> None:
        key = self._labels.get(row.id) or (row.queue, UNREGISTERED)
        bucket = self._durations.get(key)
        if bucket is None:
            self._durations[key] = [seconds]
        else:
            bucket.append(seconds)

    def acked(self, worker: Any, kind: str, ids: Iterable[Any] | Mapping[int, str]) -> None:
        self._recovered()
        labels = self._labels
        popped: dict[int, tuple[str, str]] = {}

        def pop(task_id: int, default: None) -> tuple[str, str] | None:
            key = labels.pop(task_id, default)
            if key is not None:
                popped[task_id] = key
            return key

        if self._tx is not None:
            self._tx.on_rollback.append(lambda: labels.update(popped))
        if kind == "failed" and isinstance(ids, Mapping):
            retried: dict[tuple[str, str], int] = {}
            failed: dict[tuple[str, str], int] = {}
            for task_id, state in ids.items():
                key = pop(task_id, None)
                if key is not None:
                    target = failed if state == "failed" else retried
                    target[key] = target.get(key, 0) + 1
            for key, n in retried.items():
                self._inc(self._retried, key, n)
            for key, n in failed.items():
                self._inc(self._failed, key, n)
        elif kind == "cancelled":
            # No counter of their own yet: they leave the in-flight count, and count as neither
            # completed, retried nor failed.
            for task_id in ids:
                pop(task_id, None)
        else:
            done: dict[tuple[str, str], int] = {}
            for task_id in ids:
                key = pop(task_id, None)
                if key is not None:
                    done[key] = done.get(key, 0) + 1
            for key, n in done.items():
                self._inc(self._completed, key, n)
        self._flush_durations()
        self.m.in_flight.set(len(self._labels))

    # the rest

    def lost(self, worker: Any, row: Claimed) -> None:
        key = self._labels.pop(row.id, None) or (row.queue, UNREGISTERED)
        self._lost(key).inc()
        self.m.in_flight.set(len(self._labels))

    def rescued(self, worker: Any, rows: list[tuple[int, str, str, str]]) -> None:
        self._recovered()
        known = worker.registry.get
        rescued: dict[tuple[str, str], int] = {}
        failed: dict[tuple[str, str], int] = {}
        for _id, queue, task, state in rows:
            key = (queue, task if known(task) is not None else UNREGISTERED)
            rescued[key] = rescued.get(key, 0) + 1
            if state == "failed":
                failed[key] = failed.get(key, 0) + 1
        for key, n in rescued.items():
            self._inc(self._rescued, key, n)
        for key, n in failed.items():
            self._inc(self._failed, key, n)

    def db_error(self, worker: Any, exc: BaseException) -> None:
        self.m.db_errors.inc()
        self._outage = True

    def cron_enqueued(self, worker: Any, count: int) -> None:
        """Cron code may also report per schedule on the event bus; count only what it did not."""
        self._recovered()
        m = self.m
        with m.cron_lock:
            seen = min(m.cron_from_bus, count)
            m.cron_from_bus -= seen
        if count > seen:
            m.cron.labels("(unknown)").inc(count - seen)

    # helpers

    def _recovered(self) -> None:
        if self._outage:
            self._outage = False
            self.m.db_reconnects.inc()

    def _flush_durations(self) -> None:
        if self._durations:
            for key, values in self._durations.items():
                _observe_many(self._duration(key), values)
            self._durations = {}

    def _trim(self) -> None:
        """Forget the oldest entries: rows lost when their acknowledgement found another owner
        are never acknowledged to the hooks, and must not pile up."""
        excess = len(self._labels) - self._limit // 2
        for task_id in list(self._labels)[:excess]:
            del self._labels[task_id]


def worker_hooks(enabled: bool) -> Hooks:
    """The hooks ``worker run`` gives its Worker: counting ones only when metrics are served."""
    return MetricsHooks() if enabled else Hooks()


__all__ = ["MetricsHooks", "worker_hooks"]
