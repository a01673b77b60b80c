"""The metric instruments a worker process counts with, and every series name /metrics exports.

Built lazily, once per process (``instruments()``): only a worker with metrics on pays for
prometheus-client's import and, in multiprocess mode, for its files. prometheus-client is
imported inside ``_Instruments`` on purpose: it picks single- or multi-process storage at import
from PROMETHEUS_MULTIPROC_DIR, which the supervisor sets before its children start.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Any

from ...hooks import subscribe

log = logging.getLogger("worker.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
TTL_ENV = "WORKER_METRICS_TTL"
COUNT_CAP_ENV = "WORKER_METRICS_COUNT_CAP"
DEFAULT_TTL = 10.0
DEFAULT_COUNT_CAP = 10_000

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
    "worker_queues_in_other": "gauge",
    "worker_queue_names_truncated": "gauge",
    "worker_queue_unserved_tasks": "gauge",
    "worker_queue_paused": "gauge",
    "worker_queue_limit": "gauge",
    "worker_queue_limited_running": "gauge",
    "worker_queue_limited_waiting": "gauge",
    "worker_unserved_queues": "gauge",
    "worker_tasks_without_handler": "gauge",
    "worker_doctor_findings": "gauge",
    "worker_db_xmin_horizon_age_seconds": "gauge",
    "worker_db_xmin_horizon_age_xids": "gauge",
    "worker_db_dead_tuples": "gauge",
    "worker_db_table_size_bytes": "gauge",
    "worker_db_connections": "gauge",
    "worker_workflow_steps": "gauge",
    "worker_workflows_running": "gauge",
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
    """Lock and cron events from code that has no worker at hand (see worker.hooks.emit)."""
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


def bucket_counts(bounds: Sequence[float], values: Iterable[float]) -> dict[int, int]:
    """How many of ``values`` fall in each bucket (by index; ``bounds`` ends with +Inf)."""
    counts: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)
        counts[i] = counts.get(i, 0) + 1
    return counts


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
