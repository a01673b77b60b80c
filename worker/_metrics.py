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

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from ._hooks import Hooks, subscribe
from ._journal import (
    Journal,
    Sample,
    bucket_counts,
    counter_samples,
    histogram_samples,
    journal_paths,
    settle,
)

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ._registry import TaskDef
    from ._transitions import Claimed
    from ._web import Database, WebServer

log = logging.getLogger("worker.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
TTL_ENV = "WORKER_METRICS_TTL"
COUNT_CAP_ENV = "WORKER_METRICS_COUNT_CAP"
DEFAULT_TTL = 10.0
DEFAULT_COUNT_CAP = 100_000

# Label value for tasks this worker has no handler for: their names come from whatever a producer
# wrote, so they must not become label values (a typo loop could create thousands of series).
UNREGISTERED = "(unregistered)"

# Seconds. Latency spans a busy queue's milliseconds to a backlog's hour; durations likewise.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
)  # fmt: skip
DURATION_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

# Every series name the code can export, for the deploy tests (dashboards and alert rules must
# only use these) and for docs/deploy.md.
WORKER_METRICS: dict[str, str] = {
    "worker_tasks_claimed_total": "counter",
    "worker_tasks_completed_total": "counter",
    "worker_tasks_retried_total": "counter",
    "worker_tasks_failed_total": "counter",
    "worker_tasks_rescued_total": "counter",
    "worker_tasks_lost_total": "counter",
    "worker_task_duration_seconds": "histogram",
    "worker_task_latency_seconds": "histogram",
    "worker_claim_batch_size": "histogram",
    "worker_tasks_in_flight": "gauge",
    "worker_processes": "gauge",
    "worker_db_errors_total": "counter",
    "worker_db_reconnects_total": "counter",
    "worker_cron_runs_enqueued_total": "counter",
    "worker_lock_acquisitions_total": "counter",
}
DATABASE_METRICS: dict[str, str] = {
    "worker_database_up": "gauge",
    "worker_queue_tasks": "gauge",
    "worker_queue_tasks_capped": "gauge",
    "worker_queue_delayed_tasks": "gauge",
    "worker_queue_oldest_task_age_seconds": "gauge",
    "worker_tasks_estimated": "gauge",
    "worker_workers_alive": "gauge",
    "worker_queue_stats_duration_seconds": "gauge",
    "worker_queue_stats_age_seconds": "gauge",
}


def exported_series() -> set[str]:
    """Every sample name /metrics can contain (histograms expand to _bucket, _sum and _count)."""
    names: set[str] = set()
    for name, kind in {**WORKER_METRICS, **DATABASE_METRICS}.items():
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


# -- the instruments, created once per process -----------------------------------------------------


class _Instruments:
    """The metric objects. Built lazily, once per process: only a worker with metrics on pays for
    prometheus-client's import and, in multiprocess mode, for its files."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        qt = ["queue", "task"]
        self.claimed = Counter("worker_tasks_claimed", "Tasks claimed by workers.", qt)
        self.completed = Counter(
            "worker_tasks_completed", "Tasks that finished successfully (acknowledged done).", qt
        )
        self.retried = Counter(
            "worker_tasks_retried", "Failed attempts that were put back in the queue to retry.", qt
        )
        self.failed = Counter(
            "worker_tasks_failed",
            "Tasks that failed for good (out of attempts or DoNotRetry), including those failed "
            "by a lease-expiry rescue.",
            qt,
        )
        self.rescued = Counter(
            "worker_tasks_rescued",
            "Tasks whose lease expired (their worker died or hung), rescued by this worker.",
            qt,
        )
        self.lost = Counter(
            "worker_tasks_lost",
            "Tasks this worker was running when their lease expired and another worker rescued "
            "them; the result of that attempt was discarded.",
            qt,
        )
        self.duration = Histogram(
            "worker_task_duration_seconds",
            "Seconds a handler ran, per attempt.",
            qt,
            buckets=DURATION_BUCKETS,
        )
        self.latency = Histogram(
            "worker_task_latency_seconds",
            "Seconds from when a task was due (the later of run_at and created_at) until a worker "
            "claimed it.",
            qt,
            buckets=LATENCY_BUCKETS,
        )
        self.batch = Histogram(
            "worker_claim_batch_size",
            "Tasks per claim statement that returned rows.",
            ["queue"],
            buckets=BATCH_BUCKETS,
        )
        self.in_flight = Gauge(
            "worker_tasks_in_flight",
            "Tasks claimed and not yet acknowledged.",
            multiprocess_mode="livesum",
        )
        self.processes = Gauge(
            "worker_processes", "Worker processes running.", multiprocess_mode="livesum"
        )
        self.db_errors = Counter(
            "worker_db_errors", "Database errors that interrupted a worker's loop."
        )
        self.db_reconnects = Counter(
            "worker_db_reconnects",
            "Recoveries after database errors: counted at the worker's first successful claim, "
            "acknowledgement, rescue or cron tick after an outage.",
        )
        self.cron = Counter(
            "worker_cron_runs_enqueued",
            "Cron runs enqueued, per schedule.",
            ["schedule"],
        )
        self.locks = Counter(
            "worker_lock_acquisitions",
            "Lock acquisition attempts by result (won or lost). Lock names are not labels: they "
            "may be built from ids.",
            ["kind", "result"],
        )
        self.cron_from_bus = 0  # runs the event bus reported since the last cron_enqueued hook
        self.cron_lock = threading.Lock()


_instruments: _Instruments | None = None
_instruments_lock = threading.Lock()


def instruments() -> _Instruments:
    global _instruments
    with _instruments_lock:
        if _instruments is None:
            _instruments = _Instruments()
            subscribe(_on_event)
        return _instruments


def _on_event(event: str, **fields: Any) -> None:
    """Lock and cron events from code that has no worker at hand (see _hooks.emit)."""
    m = _instruments
    if m is None:
        return
    if event == "lock":
        kind = str(fields.get("kind") or "lock")[:40]
        m.locks.labels(kind, "won" if fields.get("won") else "lost").inc()
    elif event == "cron_enqueued":
        count = int(fields.get("count") or 0)
        if count > 0:
            m.cron.labels(str(fields.get("schedule") or "")[:200]).inc(count)
            with m.cron_lock:
                m.cron_from_bus += count


def _observe_many(child: Any, values: list[float], counts: dict[int, int] | None = None) -> None:
    """Add a batch of observations to one histogram child with one increment per bucket touched.

    prometheus-client has no batch API; its ``observe`` costs a lock (and, in multiprocess mode,
    a file write) per call, twice per value. This uses the same internals ``observe`` does; should a
    future version change them, it falls back to observing one value at a time.
    """
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            child.observe(v)
        return
    if counts is None:
        counts = bucket_counts(bounds, values)
    for i, n in counts.items():
        buckets[i].inc(n)
    total.inc(sum(values))


class _Children:
    """``metric.labels(...)`` looked up once per label set: the lookup takes a lock."""

    __slots__ = ("_cache", "_metric", "name")

    def __init__(self, metric: Any, name: str = "") -> None:
        self._metric = metric
        self.name = name  # the sample name, for the journal
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, key: tuple[str, ...]) -> Any:
        child = self._cache.get(key)
        if child is None:
            child = self._cache[key] = self._metric.labels(*key)
        return child


# -- the hooks -------------------------------------------------------------------------------------


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
        # Under a supervisor only (see _journal): a process on its own loses all its counts when
        # it dies anyway.
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

    # transactions (see _hooks.Hooks.begin)

    def begin(self) -> None:
        self._tx = _Txn()

    def prepare(self, worker: Any, conn: Any) -> None:
        tx = self._tx
        if tx is None or not tx.samples or self._journal is None:
            return
        # The claim statement returns the transaction id; only acknowledgements without a claim
        # (an idle or stopping worker) pay a statement for it.
        xid = tx.xid or conn.execute(worker.q["metrics_current_xact_id"]).fetchone()[0]
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


# -- multiprocess mode -----------------------------------------------------------------------------


def prepare_multiprocess_dir() -> str:
    """Create a fresh, empty directory for the children's metric files and export it.

    Fresh matters: files left by an earlier run would be added to this run's counters. Children
    inherit the variable (the supervisor copies ``os.environ`` into their environment), so their
    prometheus-client is in multiprocess mode from its first import. A directory the user chose
    through the variable is kept as the parent of ours (it may be a tmpfs or a mounted volume).
    """
    base = os.environ.get(MULTIPROC_ENV)
    path = tempfile.mkdtemp(
        prefix="worker-metrics-", dir=base if base and os.path.isdir(base) else None
    )
    os.environ[MULTIPROC_ENV] = path
    return path


def child_exited(pid: int, path: str) -> None:
    """A child died or was killed: drop its live gauges (tasks in flight, processes) and keep its
    counters and histograms, so nothing it counted is lost."""
    if not os.path.isdir(path):
        return
    with contextlib.suppress(Exception):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, path)


class _Forward:
    """Serves the default registry's metrics through another registry (single-process mode)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        yield from self._registry.collect()


class DatabaseCollector:
    """Queue gauges for /metrics, from the cached snapshot of ``_web.Database``."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration; collect() reads the database

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        snap = self.db.queue_snapshot()
        up = GaugeMetricFamily(
            "worker_database_up",
            "1 when the last queue statistics query succeeded, 0 when the database failed.",
        )
        up.add_metric([], 0.0 if snap.error else 1.0)
        yield up
        age = GaugeMetricFamily(
            "worker_queue_stats_age_seconds", "Age of the cached queue statistics."
        )
        age.add_metric([], max(snap.age(), 0.0))
        yield age
        if snap.error:
            return
        took = GaugeMetricFamily(
            "worker_queue_stats_duration_seconds",
            "Seconds the last queue statistics query set took in the database.",
        )
        took.add_metric([], snap.duration)
        yield took
        tasks = GaugeMetricFamily(
            "worker_queue_tasks",
            "Queued (due and delayed) and in-progress tasks per queue; exact up to a cap per "
            "queue (see worker_queue_tasks_capped). Fleet-wide: aggregate with max, not sum.",
            labels=["queue", "state"],
        )
        capped = GaugeMetricFamily(
            "worker_queue_tasks_capped",
            "1 when a queue's queued count reached the counting cap and is a lower bound.",
            labels=["queue"],
        )
        delayed = GaugeMetricFamily(
            "worker_queue_delayed_tasks",
            "Queued tasks whose run_at is in the future (retries waiting, scheduled tasks).",
            labels=["queue"],
        )
        oldest = GaugeMetricFamily(
            "worker_queue_oldest_task_age_seconds",
            "Seconds the oldest due task of the queue has waited (0 when none is due).",
            labels=["queue"],
        )
        for q in snap.queues:
            tasks.add_metric([q.queue, "queued"], q.queued)
            tasks.add_metric([q.queue, "in_progress"], q.running)
            capped.add_metric([q.queue], 1.0 if q.capped else 0.0)
            delayed.add_metric([q.queue], q.delayed)
            oldest.add_metric([q.queue], q.oldest_seconds or 0.0)
        yield from (tasks, capped, delayed, oldest)
        est = GaugeMetricFamily(
            "worker_tasks_estimated",
            "Rows per state in the whole task table, from the planner's statistics (as fresh as "
            "the last autovacuum analyze).",
            labels=["state"],
        )
        for state, n in sorted(snap.estimates.items()):
            est.add_metric([state], n)
        yield est
        alive = GaugeMetricFamily(
            "worker_workers_alive",
            "Worker processes in the whole fleet with a recent heartbeat. Fleet-wide: every "
            "machine reports the same value; aggregate with max.",
        )
        alive.add_metric([], snap.workers_alive)
        yield alive


def build_registry(db: Database, *, multiprocess_dir: str | None) -> Any:
    """The registry /metrics serves: the workers' metrics plus the database gauges."""
    from prometheus_client import REGISTRY, CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    if multiprocess_dir:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
    else:
        registry.register(_Forward(REGISTRY))  # type: ignore[arg-type]
    collector: Collector = DatabaseCollector(db)  # type: ignore[assignment]
    registry.register(collector)
    return registry


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value >= 0 else default


class MetricsServer:
    """What ``serve`` returns: the running HTTP server and what it owns."""

    def __init__(
        self,
        web: WebServer,
        db: Database,
        multiprocess_dir: str | None,
        previous_env: str | None = None,
        *,
        dsn: str = "",
        schema: str = "worker",
    ) -> None:
        self.web = web
        self.db = db
        self.multiprocess_dir = multiprocess_dir
        self._previous_env = previous_env
        self._dsn = dsn
        self._schema = schema

    def child_exited(self, pid: int) -> None:
        """The supervisor's callback for a child that is gone, however it went: drop its live
        gauges now, and settle its journal in the background (that may wait for the database)."""
        path = self.multiprocess_dir
        if not path:
            return
        child_exited(pid, path)
        if any(os.path.exists(p) for p in journal_paths(path, pid)):
            threading.Thread(
                target=self._settle, args=(pid, path), name=f"settle-{pid}", daemon=True
            ).start()

    def _settle(self, pid: int, path: str) -> None:
        try:
            settle(pid, path, self._dsn, self._schema)
        except Exception:
            log.exception("could not settle the metrics of worker pid %d", pid)

    @property
    def port(self) -> int:
        return self.web.port

    @property
    def url(self) -> str:
        return self.web.url

    def stop(self) -> None:
        self.web.stop()
        self.db.close()
        if self.multiprocess_dir:
            shutil.rmtree(self.multiprocess_dir, ignore_errors=True)
            if os.environ.get(MULTIPROC_ENV) == self.multiprocess_dir:
                _restore_env(self._previous_env)
            self.multiprocess_dir = None


def serve(
    host: str,
    port: int,
    *,
    dsn: str,
    schema: str,
    multiprocess: bool = False,
    ttl: float | None = None,
    count_cap: int | None = None,
) -> MetricsServer:
    """Serve /metrics, /healthz, /readyz and the status page at ``/`` until ``stop()``.

    ``multiprocess``: this process is a supervisor whose children do the work; call it before the
    first child starts, so that they inherit a fresh PROMETHEUS_MULTIPROC_DIR.
    """
    from ._web import Database, WebServer

    db = Database(
        dsn,
        schema,
        ttl=_env_float(TTL_ENV, DEFAULT_TTL) if ttl is None else ttl,
        count_cap=count_cap or int(_env_float(COUNT_CAP_ENV, DEFAULT_COUNT_CAP)) or 1,
    )
    previous = os.environ.get(MULTIPROC_ENV)
    path = prepare_multiprocess_dir() if multiprocess else None
    try:
        registry = build_registry(db, multiprocess_dir=path)
        web = WebServer(host, port, db=db, registry=registry)
    except BaseException:
        db.close()
        if path:
            shutil.rmtree(path, ignore_errors=True)
            _restore_env(previous)
        raise
    return MetricsServer(web, db, path, previous, dsn=dsn, schema=schema)


def _restore_env(previous: str | None) -> None:
    if previous is None:
        os.environ.pop(MULTIPROC_ENV, None)
    else:
        os.environ[MULTIPROC_ENV] = previous


__all__ = [
    "DATABASE_METRICS",
    "WORKER_METRICS",
    "MetricsHooks",
    "MetricsServer",
    "child_exited",
    "exported_series",
    "prepare_multiprocess_dir",
    "serve",
    "worker_hooks",
]
