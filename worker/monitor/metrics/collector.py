"""What /metrics serves: the workers' counters (one process's, or all children's files in
multiprocess mode) plus queue gauges read from the cached read model."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..bounds import OTHER, TOP_QUEUES, TOP_TASKS, exported, label, without_handler
from ..doctor.checkup import Report
from ..doctor.findings import CODES, SEVERITIES
from ..readmodel import Database
from .instruments import MULTIPROC_ENV

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

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
    """Queue gauges for /metrics, from the cached snapshot of ``readmodel.Database``.

    Per-queue series only for the queues live workers serve and the ``TOP_QUEUES`` largest
    others; the rest are summed under ``queue="(other)"``, so a producer that writes twenty
    thousand queue names adds no series (see ``bounds``).
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration; collect() reads the database

    def collect(self) -> Iterator[Any]:
        yield from self._queue_families()
        yield from health_families(self.db.health())

    def _queue_families(self) -> Iterator[Any]:
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
            "Tasks per queue and state: scheduled (waiting for their run_at), queued (due) and "
            "in_progress. Exact up to a cap per queue; beyond it the planner's estimate when "
            "larger, else the cap (see worker_queue_tasks_capped). Fleet-wide: aggregate with "
            "max, not sum.",
            labels=["queue", "state"],
        )
        capped = GaugeMetricFamily(
            "worker_queue_tasks_capped",
            "1 when a queue's queued or scheduled count reached the counting cap: the value is "
            "then the planner's estimate or the cap, not an exact count.",
            labels=["queue"],
        )
        delayed = GaugeMetricFamily(
            "worker_queue_delayed_tasks",
            "Scheduled tasks (run_at in the future: retries waiting, delayed tasks); the same "
            'value as worker_queue_tasks{state="scheduled"}.',
            labels=["queue"],
        )
        oldest = GaugeMetricFamily(
            "worker_queue_oldest_task_age_seconds",
            "Seconds the oldest due task of the queue has waited (0 when none is due).",
            labels=["queue"],
        )
        unserved = GaugeMetricFamily(
            "worker_queue_unserved_tasks",
            "Due tasks in a queue that no live worker serves (0 when one does): they wait until "
            "a worker with --queues naming it starts.",
            labels=["queue"],
        )
        shown = exported(snap.queues, snap.rest, TOP_QUEUES)
        for q in [*shown.queues, shown.other]:
            name = OTHER if q is shown.other else label(q.queue)
            tasks.add_metric([name, "scheduled"], q.delayed)
            tasks.add_metric([name, "queued"], q.queued)
            tasks.add_metric([name, "in_progress"], q.running)
            capped.add_metric([name], 1.0 if q.capped else 0.0)
            delayed.add_metric([name], q.delayed)
            oldest.add_metric([name], q.oldest_seconds or 0.0)
            unserved.add_metric([name], q.unserved)
        yield from (tasks, capped, delayed, oldest, unserved)
        routing = snap.routing
        count = GaugeMetricFamily(
            "worker_unserved_queues",
            "Queues holding due tasks that no live worker serves (among the queues listed; see "
            "worker_queue_names_truncated).",
        )
        count.add_metric([], len(routing.unserved))
        yield count
        without = GaugeMetricFamily(
            "worker_tasks_without_handler",
            "Tasks waiting for a handler that no live worker has, per task name: rows handed back "
            "by workers without it (exact up to the cap), plus those seen in a sample of each "
            f"queue's first queued rows. The {TOP_TASKS} largest by name, the rest summed under "
            f'task="{OTHER}".',
            labels=["task"],
        )
        for task, n in without_handler(routing.missing, TOP_TASKS):
            without.add_metric([task], n)
        yield without
        summed = GaugeMetricFamily(
            "worker_queues_in_other",
            f'Queues whose gauges are summed under queue="{OTHER}": all but the ones live '
            f"workers serve and the {TOP_QUEUES} largest. A lower bound when "
            "worker_queue_names_truncated is 1.",
        )
        summed.add_metric([], shown.other_count)
        yield summed
        truncated = GaugeMetricFamily(
            "worker_queue_names_truncated",
            "1 when there were too many queue names to list: the queues past the last name "
            f'listed are counted together under queue="{OTHER}", without an oldest age.',
        )
        truncated.add_metric([], 0.0 if snap.rest is None else 1.0)
        yield truncated
        est = GaugeMetricFamily(
            "worker_tasks_estimated",
            "Rows per state in the whole task table, from the planner's statistics (as fresh as "
            "the last autovacuum analyze).",
            labels=["state"],
        )
        for state, n in sorted(snap.estimates.items()):
            est.add_metric([state], n)
        yield est
        paused = GaugeMetricFamily(
            "worker_queue_paused",
            "1 for each queue an operator paused (`worker pause`): workers claim nothing from it "
            "until it is resumed. Fleet-wide.",
            labels=["queue"],
        )
        for name in snap.paused:
            paused.add_metric([label(name)], 1.0)
        yield paused
        limit = GaugeMetricFamily(
            "worker_queue_limit",
            "Each limit of a limited queue (schema/0014; `worker limits`): kind is concurrency, "
            "key_concurrency (running at once), rate or key_rate (starts per second). Fleet-wide.",
            labels=["queue", "kind"],
        )
        running = GaugeMetricFamily(
            "worker_queue_limited_running",
            "Tasks of a limited queue running under its limits (leases not expired); counts stop "
            "at 10,000. Fleet-wide.",
            labels=["queue"],
        )
        waiting = GaugeMetricFamily(
            "worker_queue_limited_waiting",
            "Due tasks of a limited queue waiting to start (held back when running is at the "
            "limit, or the rate window is full); counts stop at 10,000. Fleet-wide.",
            labels=["queue"],
        )
        for q in snap.limits:
            lim = q.limits
            for kind, value in (
                ("concurrency", lim.concurrency),
                ("key_concurrency", lim.key_concurrency),
                ("rate", None if lim.rate is None else lim.rate[0] / lim.rate[1]),
                ("key_rate", None if lim.key_rate is None else lim.key_rate[0] / lim.key_rate[1]),
            ):
                if value is not None:
                    limit.add_metric([label(q.queue), kind], float(value))
            running.add_metric([label(q.queue)], float(q.running))
            waiting.add_metric([label(q.queue)], float(q.waiting))
        yield limit
        yield running
        yield waiting
        alive = GaugeMetricFamily(
            "worker_workers_alive",
            "Worker processes in the whole fleet with a recent heartbeat. Fleet-wide: every "
            "machine reports the same value; aggregate with max.",
        )
        alive.add_metric([], snap.workers_alive)
        yield alive
        steps = GaugeMetricFamily(
            "worker_workflow_steps",
            "Steps of workflows not finished, by state: waiting (for their dependencies), "
            "scheduled, queued, in_progress. Counts stop at the queue statistics' cap. Fleet-wide.",
            labels=["state"],
        )
        flows = snap.workflows or {}
        for state in ("waiting", "scheduled", "queued", "in_progress"):
            steps.add_metric([state], float((flows.get("steps") or {}).get(state, 0)))
        yield steps
        running_flows = GaugeMetricFamily(
            "worker_workflows_running",
            "Workflows with at least one step not finished. Fleet-wide.",
        )
        running_flows.add_metric([], float(flows.get("workflows", 0)))
        yield running_flows


def health_families(report: Report) -> Iterator[Any]:
    """The gauges of `worker doctor`'s cheap checks (no claim probe at scrape time), from the
    read model's cached report: the xmin horizon's age, dead rows and sizes per queue table,
    connections, and the findings by code and severity."""
    from prometheus_client.core import GaugeMetricFamily

    findings = GaugeMetricFamily(
        "worker_doctor_findings",
        "Findings of `worker doctor`'s checks (without the claim probe) per code and severity: "
        'alert on severity!="ok". check_failed counts checks that could not run.',
        labels=["code", "severity"],
    )
    counts: dict[tuple[str, str], int] = {}
    for f in report.findings:
        counts[(f.code, f.severity)] = counts.get((f.code, f.severity), 0) + 1
    for (code, severity), n in sorted(counts.items()):
        if code in CODES and severity in SEVERITIES:  # a fixed set of label values
            findings.add_metric([code, severity], n)
    yield findings
    if report.error:
        return
    figures = report.figures
    horizon = GaugeMetricFamily(
        "worker_db_xmin_horizon_age_seconds",
        "Age of the oldest transaction or prepared transaction holding back the xmin horizon of "
        "the queue's database (vacuum cannot remove rows that died since); 0 when none does.",
    )
    horizon.add_metric([], float(figures.get("xmin_horizon_age_seconds") or 0.0))
    yield horizon
    xids = GaugeMetricFamily(
        "worker_db_xmin_horizon_age_xids",
        "The same horizon's age in transactions, replication slots included.",
    )
    xids.add_metric([], float(figures.get("xmin_horizon_age_xids") or 0))
    yield xids
    dead = GaugeMetricFamily(
        "worker_db_dead_tuples",
        "Dead row versions per table of the queue's schema (pg_stat_user_tables.n_dead_tup).",
        labels=["table"],
    )
    sizes = GaugeMetricFamily(
        "worker_db_table_size_bytes",
        "Size per table of the queue's schema: the table (with TOAST) or its indexes.",
        labels=["table", "part"],
    )
    for name, t in sorted((figures.get("tables") or {}).items()):
        dead.add_metric([label(name)], t["dead"])
        sizes.add_metric([label(name), "table"], t["table_bytes"])
        sizes.add_metric([label(name), "indexes"], t["index_bytes"])
    yield from (dead, sizes)
    conns = figures.get("connections")
    if conns:
        gauge = GaugeMetricFamily(
            "worker_db_connections",
            "Client connections to the server: used (all), fleet (application_name worker*) and "
            "limit (what non-superusers may open).",
            labels=["kind"],
        )
        for kind in ("used", "fleet", "limit"):
            gauge.add_metric([kind], conns[kind])
        yield gauge


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
