"""Helpers for testing handlers and enqueue paths: no worker process, no waiting.

``run_due(conn)`` runs the tasks that are due, one after the other, in the calling thread and on
the caller's connection, inside whatever transaction it has open: a test that enqueues, runs and
then rolls back leaves nothing behind. Rows move through the queue's own statements
(``the store``: claim, complete, retry), so states, attempts, backoff and errors are the ones
a worker would write. ``enqueued`` and ``assert_enqueued`` read what was enqueued.
``run_workflow(flow)`` runs a workflow's steps in dependency order, with no database at all.

Time stands still inside a transaction (``now()`` is its start), so a retried task, whose next
attempt is scheduled after a backoff, is not due again within the same ``run_due``; neither is a
delayed task. ``run_due(conn, now=...)`` runs "as of" a later time: rows scheduled up to then
are made due first, on every round, so retries run again until their attempts are used up.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from . import store
from .db.sql import notify_channel, queries
from .engine.batch import PROMOTE_LIMIT
from .engine.job import decode_inputs, decode_payload, format_error
from .errors import DoNotRetry, PayloadError
from .tasks.backoff import retry_delay
from .tasks.payload import from_json, to_json
from .tasks.registry import Context, Registry, TaskDef, registry
from .tasks.results import encode_result
from .tasks.workflow import Step, Workflow

# The lease written on rows run_due claims; nothing renews or checks it while they run.
_LEASE_SECONDS = 3600.0
_BATCH = 100

# testing.sql lies beside this module: a worker process never loads it.
_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class TaskRun:
    """One attempt run_due made: the row's state afterwards (done, scheduled or queued for a
    retry, failed), and the error when it did not succeed."""

    id: int
    task: str
    attempt: int
    ok: bool
    state: str
    error: str | None = None
    handed_back: bool = False  # no handler for it in the registry: not run, attempt not counted


@dataclass(frozen=True)
class RunSummary:
    runs: list[TaskRun]

    @property
    def ran(self) -> int:
        """Handler calls (handed-back rows were not run)."""
        return sum(1 for r in self.runs if not r.handed_back)

    @property
    def succeeded(self) -> list[TaskRun]:
        return [r for r in self.runs if r.ok]

    @property
    def failed(self) -> list[TaskRun]:
        return [r for r in self.runs if not r.ok and not r.handed_back]

    @property
    def handed_back(self) -> list[TaskRun]:
        return [r for r in self.runs if r.handed_back]

    def check(self) -> RunSummary:
        """Raise AssertionError naming every failed attempt and unknown task; else self."""
        bad = [*self.failed, *self.handed_back]
        lines = [f"  #{r.id} {r.task} attempt {r.attempt} -> {r.state}: {_first(r)}" for r in bad]
        if bad:
            head = f"{len(bad)} of {len(self.runs)} task run(s) failed:\n"
            raise AssertionError(head + "\n".join(lines))
        return self


def run_due(
    conn: psycopg.Connection,
    tasks: Registry | None = None,
    *,
    schema: str = "worker",
    queues: list[str] | None = None,
    limit: int = 1000,
    now: datetime | timedelta | None = None,
) -> RunSummary:
    """Run every due task (of ``queues``, default all) with the handlers of ``tasks`` (default
    the global registry), until none is due or ``limit`` attempts were made; tasks the handlers
    enqueue on ``conn`` run too. ``now``: run as if the database's clock read this (a datetime,
    or a timedelta from now), which makes delayed tasks and pending retries due.

    Sync handlers run in this thread, ``async def`` ones on an event loop of this call (so do not
    call it from a running loop), transactional ones inside a savepoint of ``conn``'s
    transaction with ``ctx.conn = conn``. Handler timeouts are enforced for async handlers only.
    """
    q = queries(schema, _HERE)
    tasks = tasks if tasks is not None else registry
    until = _until(conn, schema, now)
    worker_id = str(uuid.uuid4())
    limits = {name: d.max_attempts for name in tasks.names() if (d := tasks.get(name))}
    runs: list[TaskRun] = []
    with asyncio.Runner() as loop:  # its event loop is made on first use only
        while len(runs) < limit:
            if until is not None:
                store.make_due(conn, schema, until=until)
            store.promote(conn, schema, limit=PROMOTE_LIMIT, channel=notify_channel(schema))
            names = queues or [r[0] for r in conn.execute(q["testing_due_queues"]).fetchall()]
            if not names:
                break
            rows = store.claim(
                conn,
                schema,
                queues=names,
                limit=min(_BATCH, limit - len(runs)),
                worker_id=worker_id,
                lease_seconds=_LEASE_SECONDS,
                max_attempts=limits,
            )
            if not rows:
                break
            for c in rows:
                runs.append(_run_one(conn, schema, tasks, c, worker_id, loop))
    return RunSummary(runs)


def _until(conn: psycopg.Connection, schema: str, now: datetime | timedelta | None) -> Any:
    if isinstance(now, timedelta):
        return store.delayed_until(conn, schema, now.total_seconds())
    if now is not None and now.tzinfo is None:
        raise ValueError("now must be timezone-aware (naive datetimes are ambiguous)")
    return now


def _run_one(
    conn: psycopg.Connection,
    schema: str,
    tasks: Registry,
    c: store.Claimed,
    worker_id: str,
    loop: asyncio.Runner,
) -> TaskRun:
    d = tasks.get(c.task)
    if d is None:
        # As a worker would: back to scheduled, attempt not counted (see store.hand_back).
        error = (
            f"UnknownTask: no handler named {c.task!r} in the registry run_due was given "
            f"(known: {', '.join(tasks.names()) or 'none'})"
        )
        store.hand_back(conn, schema, worker_id=worker_id, rows=[(c.id, c.attempt, error)])
        return TaskRun(c.id, c.task, c.attempt, False, "scheduled", error, handed_back=True)
    ctx = Context(c.id, c.task, c.queue, c.attempt, c.max_attempts, worker_id)
    if c.workflow_id is not None:  # a workflow's step (see worker.Workflow)
        ctx.workflow_id, ctx.inputs = c.workflow_id, decode_inputs(c.inputs)
    permanent = False
    try:
        payload = decode_payload(c.payload)
        if d.payload is not None:
            payload = from_json(c.task, d.payload, payload)
    except PayloadError as exc:
        error, permanent = f"PayloadError: {exc}; not retried", True
    except Exception as exc:
        error, permanent = f"PayloadError: the payload cannot be decoded ({exc})", True
    else:
        try:
            if d.transactional:
                with conn.transaction():  # a savepoint: the handler's writes go with the row
                    value = d.fn(payload, replace(ctx, conn=conn))
                    text = encode_result(value) if c.dependents else None
                    _finish(conn, schema, worker_id, c, text)
                return TaskRun(c.id, c.task, c.attempt, True, "done")
            value = _call(d, payload, ctx, loop)
            text = encode_result(value) if c.dependents else None
        except DoNotRetry as exc:
            error, permanent = format_error(exc), True
        except Exception as exc:
            error = format_error(exc)
        else:
            _finish(conn, schema, worker_id, c, text)
            return TaskRun(c.id, c.task, c.attempt, True, "done")
    delay = retry_delay(c.attempt, d.retry_backoff)
    failure = store.Failure(c.id, c.attempt, delay, error, permanent, d.max_attempts)
    state = store.fail(conn, schema, worker_id=worker_id, failures=[failure]).get(c.id, "lost")
    if c.dependents:
        store.settle_steps(conn, schema, [c.id])
    return TaskRun(c.id, c.task, c.attempt, False, state, error)


def _finish(conn: psycopg.Connection, schema: str, w: str, c: store.Claimed, text: Any) -> None:
    """Complete a row; a step others wait for hands them its result (``text``, encoded) and
    releases them, as a worker does."""
    if c.dependents:
        store.complete_with_result(conn, schema, worker_id=w, done=[(c.id, c.attempt, text)])
        store.settle_steps(conn, schema, [c.id])
    else:
        store.complete(conn, schema, worker_id=w, done=[(c.id, c.attempt)])


def _call(d: TaskDef, payload: Any, ctx: Context, loop: asyncio.Runner) -> Any:
    if d.is_async:
        coro = d.fn(payload, ctx) if d.wants_context else d.fn(payload)
        return loop.run(asyncio.wait_for(coro, d.timeout) if d.timeout else coro)
    if d.wants_context:
        return d.fn(payload, ctx)
    return d.fn(payload)


# -- workflows, in-process -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepRun:
    """One step of ``run_workflow``: how it ended (done, failed or cancelled), its result (as
    JSON would carry it), its error, and the inputs its handler was given."""

    step: Step
    state: str
    result: Any = None
    error: str | None = None
    inputs: list[Any] | None = None


@dataclass(frozen=True)
class WorkflowRun:
    steps: list[StepRun]

    def __getitem__(self, step: Step) -> StepRun:
        return next(r for r in self.steps if r.step is step)

    def check(self) -> WorkflowRun:
        """Raise AssertionError naming every step that did not end done; else self."""
        bad = [r for r in self.steps if r.state != "done"]
        if bad:
            lines = [
                f"  {r.step.name} -> {r.state}: {(r.error or '').splitlines()[0]}" for r in bad
            ]
            raise AssertionError(
                f"{len(bad)} of {len(self.steps)} step(s) did not finish:\n" + "\n".join(lines)
            )
        return self


def run_workflow(flow: Workflow, tasks: Registry | None = None) -> WorkflowRun:
    """Run ``flow``'s steps in this process, in dependency order, with the handlers of ``tasks``
    (default the global registry), without a database: each handler gets its payload (through
    JSON and its model, as a worker would give it) and ``ctx.inputs``, the results of its
    dependencies. A step that raises fails at once (no retries), and its dependents end
    cancelled unless their edge says ``run_on_failure``, as in the queue. Transactional handlers
    get no connection (``ctx.conn`` is None)."""
    tasks = tasks if tasks is not None else registry
    ended: dict[Step, StepRun] = {}
    with asyncio.Runner() as loop:
        for s in flow.order():
            blocked = next(
                (
                    e.step
                    for e in s.depends_on
                    if ended[e.step].state != "done" and not e.run_on_failure
                ),
                None,
            )
            if blocked is not None:
                why = f"DependencyFailed: step {blocked.name} ended {ended[blocked].state}"
                ended[s] = StepRun(s, "cancelled", error=why)
                continue
            inputs = [ended[e.step].result for e in s.depends_on]
            ended[s] = _run_step(s, inputs, tasks, loop)
    return WorkflowRun([ended[s] for s in flow.steps])


def _run_step(s: Step, inputs: list[Any], tasks: Registry, loop: asyncio.Runner) -> StepRun:
    name = s.task.name if isinstance(s.task, TaskDef) else s.task
    d = tasks.get(name)
    if d is None:
        return StepRun(s, "failed", error=f"UnknownTask: no handler named {name!r}", inputs=inputs)
    ctx = Context(-1 - s.index, name, s.queue or d.queue, 1, d.max_attempts, "testing")
    ctx.inputs, ctx.workflow_id = inputs, 0
    try:
        stored = json.loads(
            json.dumps(to_json(name, {} if s.payload is None else s.payload, d.payload))
        )
        payload = from_json(name, d.payload, stored) if d.payload is not None else stored
        value = _call(d, payload, ctx, loop)
        result = json.loads(encode_result(value))
    except Exception as exc:
        return StepRun(s, "failed", error=format_error(exc), inputs=inputs)
    return StepRun(s, "done", result=result, inputs=inputs)


# -- what was enqueued -------------------------------------------------------------------------


@dataclass(frozen=True)
class Enqueued:
    """A task row as a test sees it (payload as stored: plain JSON)."""

    id: int
    task: str
    payload: Any
    queue: str
    priority: int
    run_at: datetime
    state: str
    attempts: int
    max_attempts: int | None
    last_error: str | None


def enqueued(
    conn: psycopg.Connection,
    task: str | TaskDef | None = None,
    *,
    queue: str | None = None,
    schema: str = "worker",
) -> list[Enqueued]:
    """The task rows visible to ``conn`` (its own uncommitted ones included), oldest first,
    whatever their state; of one task and one queue when given."""
    name = task.name if isinstance(task, TaskDef) else task
    rows = conn.execute(queries(schema, _HERE)["testing_enqueued"], {"task": name, "queue": queue})
    return [Enqueued(*row) for row in rows.fetchall()]


_ANY: Any = object()


def assert_enqueued(
    conn: psycopg.Connection,
    task: str | TaskDef,
    payload: Any = _ANY,
    *,
    queue: str | None = None,
    count: int | None = None,
    schema: str = "worker",
) -> list[Enqueued]:
    """The rows of ``task`` (with this payload, in this queue, when given); fails unless there is
    at least one, or exactly ``count``, listing what was enqueued instead. ``payload`` compares
    with the stored JSON; a model instance or dict of a typed task is serialised first."""
    name = task.name if isinstance(task, TaskDef) else task
    want = _ANY
    if payload is not _ANY:
        d = registry.get(name) if isinstance(task, str) else task
        want = json.loads(json.dumps(to_json(name, payload, d.payload if d else None)))
    everything = enqueued(conn, schema=schema)
    found = [
        r
        for r in everything
        if r.task == name
        and (queue is None or r.queue == queue)
        and (want is _ANY or r.payload == want)
    ]
    if (count is None and found) or len(found) == count:
        return found
    what = f"{name!r}" + ("" if want is _ANY else f" with payload {json.dumps(want)}")
    what += "" if queue is None else f" in queue {queue!r}"
    expected = "at least 1" if count is None else str(count)
    lines = [_describe(r) for r in everything[:20]]
    if len(everything) > 20:
        lines.append(f"  ... and {len(everything) - 20} more")
    raise AssertionError(
        f"expected {expected} task(s) {what}, found {len(found)}; enqueued "
        + (f"({len(everything)}):\n" + "\n".join(lines) if everything else ": nothing")
    )


def _describe(r: Enqueued) -> str:
    return (
        f"  #{r.id} {r.task} queue={r.queue} state={r.state} priority={r.priority} "
        f"payload={json.dumps(r.payload)[:300]}"
    )


def _first(r: TaskRun) -> str:
    return (r.error or "").splitlines()[0] if r.error else ""


__all__ = [
    "Enqueued",
    "RunSummary",
    "StepRun",
    "TaskRun",
    "WorkflowRun",
    "assert_enqueued",
    "enqueued",
    "run_due",
    "run_workflow",
]
