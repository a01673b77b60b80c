"""What operators read of workflows: one workflow with its steps (``worker status --workflow``)
and the counts the metrics, the overview and ``worker status`` show (the console's page of one
workflow has its own bounded reads, in monitor/console/workflow.sql). Cancelling a workflow is
``cancel_workflow`` in SQL (schema/0022), through ``store.cancel_workflow``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from ..db.sql import queries

STEP_LIMIT = 1000


@dataclass(frozen=True)
class StepRow:
    id: int
    task: str
    queue: str
    state: str
    attempts: int
    pending: int | None
    depends_on: list[int]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    seconds: float | None
    last_error: str | None


@dataclass(frozen=True)
class WorkflowStatus:
    id: int
    name: str
    created_at: datetime
    counts: dict[str, int]
    steps: list[StepRow] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def finished(self) -> bool:
        return all(s in ("done", "failed", "cancelled") for s in self.counts)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["total"], out["finished"] = self.total, self.finished
        return out


def workflow_status(
    conn: psycopg.Connection, schema: str, workflow_id: int, *, limit: int = STEP_LIMIT
) -> WorkflowStatus | None:
    """The workflow, its counts by state, and its first ``limit`` steps; None if unknown."""
    q = queries(schema)
    head = conn.execute(q["workflow_get"], {"id": workflow_id}).fetchone()
    if head is None:
        return None
    counts = {s: int(n) for s, n in conn.execute(q["workflow_counts"], {"id": workflow_id})}
    steps = [
        StepRow(*r) for r in conn.execute(q["workflow_steps"], {"id": workflow_id, "limit": limit})
    ]
    return WorkflowStatus(head[0], head[1], head[2], counts, steps)


def workflow_gauges(conn: psycopg.Connection, schema: str, cap: int = 100_000) -> dict[str, Any]:
    """Steps of workflows not finished, read up to ``cap`` of them: {"steps": {state: n},
    "queues": {queue: waiting steps}, "workflows": n, "capped": whether the read stopped at
    ``cap`` (every count is then a lower bound)}."""
    rows = conn.execute(queries(schema)["metrics_workflows"], {"cap": cap}).fetchall()
    out: dict[str, Any] = {"steps": {}, "queues": {}, "workflows": 0, "capped": False}
    for state, queue, steps, flows, g in rows:
        if g == 1:
            out["steps"][state] = int(steps)
        elif g == 2 and queue is not None:
            out["queues"][queue] = int(steps)
        elif g == 3:
            out["workflows"], out["capped"] = int(flows), int(steps) >= cap
    return out


__all__ = ["STEP_LIMIT", "StepRow", "WorkflowStatus", "workflow_gauges", "workflow_status"]
