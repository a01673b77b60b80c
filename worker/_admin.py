"""Read-only views of the queue and the operator actions, shared by the CLI and the status page.

The actions' writes are in ``_transitions``, with every other change of a task's state."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row

from . import _transitions as tr
from ._sql import notify_channel, queries


@dataclass
class QueueStatus:
    queue: str
    counts: dict[str, int] = field(default_factory=dict)
    delayed: int = 0
    oldest_seconds: float | None = None


@dataclass
class Status:
    queues: list[QueueStatus]
    workers: list[dict[str, Any]]
    failed: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "queues": [asdict(q) for q in self.queues],
            "workers": self.workers,
            "failed": self.failed,
        }


STATES = ("queued", "in_progress", "done", "failed", "cancelled")


def status(conn: psycopg.Connection, schema: str, *, failed_limit: int = 10) -> Status:
    q = queries(schema)
    by_queue: dict[str, QueueStatus] = {}
    for name, state, n in conn.execute(q["queue_counts"]).fetchall():
        by_queue.setdefault(name, QueueStatus(name, dict.fromkeys(STATES, 0))).counts[state] = n
    for name, delayed, oldest in conn.execute(q["queue_oldest"]).fetchall():
        entry = by_queue.setdefault(name, QueueStatus(name, dict.fromkeys(STATES, 0)))
        entry.delayed, entry.oldest_seconds = delayed, oldest
    with conn.cursor(row_factory=dict_row) as cur:
        workers = cur.execute(q["workers"]).fetchall()
        failed = cur.execute(q["recent_failed"], {"limit": failed_limit}).fetchall()
    for w in workers:
        w["id"] = str(w["id"])
    return Status(sorted(by_queue.values(), key=lambda s: s.queue), workers, failed)


def retry(conn: psycopg.Connection, schema: str, task_id: int) -> bool:
    return tr.retry_task(conn, queries(schema), task_id=task_id, channel=notify_channel(schema))


def retry_failed(conn: psycopg.Connection, schema: str, queue: str | None = None) -> int:
    return tr.retry_failed(conn, queries(schema), queue=queue, channel=notify_channel(schema))


def cancel(conn: psycopg.Connection, schema: str, task_id: int) -> bool:
    return tr.cancel_task(conn, queries(schema), task_id=task_id)


def get_task(conn: psycopg.Connection, schema: str, task_id: int) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(queries(schema)["get_task"], {"id": task_id}).fetchone()
