"""Enqueueing a workflow: its steps and edges in one transaction, by COPY, in the caller's
transaction when given a connection (like ``enqueue``), so a workflow commits with the writes
that asked for it, or not at all."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

import psycopg

from .. import hooks as _hooks
from .. import store
from ..db.connect import Target, borrow
from ..db.migrate import schema_errors
from .enqueue import _check_max_attempts, _default_queue, _key, _resolve
from .payload import to_json
from .workflow import Step, Workflow, WorkflowError


@dataclass(frozen=True)
class EnqueuedWorkflow:
    """What ``enqueue_workflow`` wrote: the workflow's id and its steps' task ids."""

    id: int
    ids: dict[Step, int]

    def __getitem__(self, step: Step) -> int:
        """The task id of ``step``."""
        return self.ids[step]


def enqueue_workflow(target: Target, flow: Workflow, *, schema: str = "worker") -> EnqueuedWorkflow:
    """Write ``flow`` (its row, its steps, its edges) in one transaction and return its ids.

    ``target``: a connection (its transaction, if open, holds the workflow until it commits), a
    pool or a DSN. A cycle, a step that depends on itself or on a step outside ``flow`` raise
    ``WorkflowError`` (one line) before anything is written; a payload that does not fit its
    task's model raises as ``enqueue`` does. With a producer observer (tracing), the call is
    one "send" and every step stores its context, so the steps' runs share its trace."""
    ordered = flow.order()
    place = {s: i for i, s in enumerate(ordered)}
    rows: list[tuple[Any, ...]] = []
    edges: list[tuple[int, int, bool, int]] = []
    for i, s in enumerate(ordered):
        rows.append(_row(s))
        for position, edge in enumerate(s.depends_on):
            edges.append((i, place[edge.step], edge.run_on_failure, position))
    if _hooks.producers:
        queues = {r[2] for r in rows}
        queue = next(iter(queues)) if len(queues) == 1 else None
        send = _hooks.Send("", queue, True, count=len(rows), workflow=flow.name)
        with _hooks.sending(send):
            workflow_id, ids = _insert(target, schema, flow, rows, edges, send.carrier)
            send.workflow_id = workflow_id
    else:
        workflow_id, ids = _insert(target, schema, flow, rows, edges, None)
    return EnqueuedWorkflow(workflow_id, {s: ids[place[s]] for s in flow.steps})


def _insert(
    target: Target,
    schema: str,
    flow: Workflow,
    rows: list[tuple[Any, ...]],
    edges: list[tuple[int, int, bool, int]],
    carrier: dict[str, str] | None,
) -> tuple[int, list[int]]:
    context = json.dumps(carrier) if carrier else None
    with schema_errors(schema), borrow(target) as conn:
        try:
            # An autocommit connection (a pool's, a DSN's) gets a transaction of its own; any
            # other is the caller's, which commits or rolls back the workflow with its writes.
            with conn.transaction() if conn.autocommit else contextlib.nullcontext():
                return store.insert_workflow(
                    conn, schema, name=flow.name, steps=rows, edges=edges, trace_context=context
                )
        except psycopg.errors.IntegrityError as exc:  # the edges' checks (schema/0022)
            raise WorkflowError(_first_line(exc)) from None


def _row(s: Step) -> tuple[Any, ...]:
    name, definition = _resolve(s.task)
    given = {} if s.payload is None else s.payload
    payload = to_json(name, given, None if definition is None else definition.payload)
    try:
        text = json.dumps(payload)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"payload of step {s.name!r} is not JSON-serialisable: {exc}") from None
    return (
        name,
        text,
        s.queue or _default_queue(definition),
        s.priority,
        _check_max_attempts(s.max_attempts),
        _key(definition, given, payload, s.limit_key),
        bool(s.depends_on),
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["EnqueuedWorkflow", "enqueue_workflow"]
