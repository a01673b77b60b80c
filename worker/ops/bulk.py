"""Bulk retry, cancel and delete by filter.

The logic lives in the database (schema/0008, 0016): ``bulk_step`` does one batch of one state,
walking that state's index from where the previous batch stopped, so that each batch is a short
transaction of its own whatever the number of rows, and psql runs the very same code through
``CALL worker.bulk(...)``. This module walks the batches (each through the store's
``bulk_step``), adds up what they did, and records who did it (``audit``).

What each action does, and to which states (the first of each list is its default when the
filter names no state):
  retry:  failed (, cancelled) -> queued, due now, attempts 0; a task whose dedupe key a live
          task holds is left as it is and reported
  cancel: scheduled, queued -> cancelled; running tasks are never touched, only counted
  delete: done, failed, cancelled (, scheduled, queued) -> deleted; never a running task

The filter's ``error`` is an ILIKE pattern over the whole last error: ``Timeout%`` is an error
that starts with "Timeout" (any case), ``%refused%`` one that holds "refused"; ``%`` and ``_``
are wildcards unless escaped with a backslash (``like_escape`` escapes a literal text).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from .. import store
from ..db.connect import Target, borrow
from ..db.sql import execute, queries
from .audit import ACTOR_CHARS, clean, finish_action, record_action

# Allowed states per action, the default ones first (schema/0008, bulk_states, says the same;
# tests/test_bulk.py checks that they agree).
ACTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "retry": (("failed", "cancelled"), ("failed",)),
    "cancel": (("scheduled", "queued"), ("scheduled", "queued")),
    "delete": (
        ("done", "failed", "cancelled", "scheduled", "queued"),
        ("done", "failed", "cancelled"),
    ),
}
WAITING = ("scheduled", "queued")
BATCH = 5_000  # rows read per statement (and transaction) when acting
COUNT_BATCH = 20_000  # rows read per statement of a dry run, which locks and writes nothing
MAX_BATCH = 100_000
MAX_IDS = 100_000
EXAMPLES = 5  # matched tasks shown by a dry run
SKIPPED_SHOWN = 20  # ids of skipped tasks kept for the report
RUNNING_CAP = 100_000  # running tasks counted at most
FILTER_IDS_KEPT = 1_000  # ids written into the record of an action; the count says how many


class BulkError(ValueError):
    """A filter or an action that cannot be run as given (the CLI's exit 2)."""


def like_escape(text: str) -> str:
    """``text`` as a literal inside an ILIKE pattern: ``f"%{like_escape(s)}%"`` matches errors
    that hold ``s`` anywhere, whatever ``%``, ``_`` or ``\\`` it holds."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


@dataclass(frozen=True)
class Filter:
    """Which tasks: every given field must match (an empty filter is refused)."""

    queue: str | None = None
    task: str | None = None
    states: tuple[str, ...] = ()  # empty: the action's default states
    error: str | None = None  # ILIKE pattern over the whole last_error
    older_than: float | None = None  # seconds: finished that long ago, or created (not started)
    ids: tuple[int, ...] = ()

    def check(self) -> None:
        for name in ("queue", "task"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise BulkError(f"{name} must be a non-empty name")
        if self.error is not None and (not isinstance(self.error, str) or not self.error):
            raise BulkError("error must be a non-empty pattern")
        if self.older_than is not None and (
            not math.isfinite(self.older_than) or self.older_than < 0
        ):
            raise BulkError("older_than must be a number of seconds, 0 or more")
        if len(self.ids) > MAX_IDS:
            raise BulkError(f"at most {MAX_IDS:,} ids")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in self.ids):
            raise BulkError("ids must be positive whole numbers")
        if self.as_json() == {}:
            raise BulkError(
                "give a filter: a queue, task, state, error pattern, age or ids (a state alone "
                "is enough)"
            )

    def as_json(self) -> dict[str, Any]:
        """The filter as schema/0008 reads it (only the keys given)."""
        out: dict[str, Any] = {}
        for name in ("queue", "task", "error"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.states:
            out["states"] = list(self.states)
        if self.older_than is not None:
            out["older_than"] = self.older_than
        if self.ids:
            out["ids"] = sorted(set(self.ids))
        return out


def states_for(action: str, flt: Filter) -> list[str]:
    """The states ``action`` walks for ``flt``, in walking order; BulkError for a state or an
    action that does not apply."""
    if action not in ACTIONS:
        raise BulkError(f"unknown action {action!r}: retry, cancel or delete")
    allowed, default = ACTIONS[action]
    if not flt.states:
        return list(default)
    wrong = [s for s in flt.states if s not in allowed]
    if wrong:
        extra = " (running tasks are never touched)" if "in_progress" in wrong else ""
        extra += " (waiting steps are a workflow's: cancel the workflow)" * ("waiting" in wrong)
        raise BulkError(
            f"{action} applies to {', '.join(allowed)} tasks, not {', '.join(wrong)}{extra}"
        )
    return [s for s in allowed if s in flt.states]


@dataclass
class Outcome:
    """What a bulk action matched and did (a dry run: what it would do)."""

    action: str
    dry_run: bool
    filter: dict[str, Any]
    states: list[str]
    matched: int = 0
    changed: int = 0
    batches: int = 0
    skipped_dedupe: int = 0  # retry: left as they are, their dedupe key being taken
    skipped_dedupe_ids: list[int] = field(default_factory=list)
    running: int = 0  # running tasks the filter matches, which are never touched
    running_ids: list[int] = field(default_factory=list)
    running_capped: bool = False
    sample_ids: list[int] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)
    actor: str | None = None
    action_id: int | None = None
    complete: bool = True
    interrupted: str | None = None  # what stopped it between two batches (a signal's name)

    @property
    def changed_meanwhile(self) -> int:
        """Matched rows that left their state before the action reached them (a worker claimed
        a queued task, say): left alone."""
        return 0 if self.dry_run else max(self.matched - self.changed - self.skipped_dedupe, 0)

    def counts(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "changed": self.changed,
            "batches": self.batches,
            "skipped": {
                "dedupe_key_taken": self.skipped_dedupe,
                "running": self.running,
                "changed_meanwhile": self.changed_meanwhile,
            },
        }

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["changed_meanwhile"] = self.changed_meanwhile
        return out


Progress = Callable[[Outcome], None]
# Asked between batches: None to go on, or why to stop (a signal's name, as "SIGTERM").
Stop = Callable[[], str | None]


def preview(
    target: Target,
    schema: str,
    action: str,
    flt: Filter,
    *,
    batch: int = COUNT_BATCH,
    examples: int = EXAMPLES,
) -> Outcome:
    """A dry run: how many tasks ``action`` would change, which it would skip, and a few of them.
    Reads in batches like the action itself (the same statement, writing nothing)."""
    out = _start(action, flt, dry_run=True, batch=batch)
    q = queries(schema)
    with borrow(target) as conn:
        _walk(conn, schema, out, flt, batch, None, keep=examples)
        _count_running(conn, schema, out, flt)
        if out.sample_ids and examples:
            with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                out.examples = cur.execute(
                    q["bulk_examples"], {"ids": out.sample_ids[:examples], "chars": 2000}
                ).fetchall()
    return out


def apply(
    target: Target,
    schema: str,
    action: str,
    flt: Filter,
    *,
    actor: str,
    source: str = "python",
    batch: int = BATCH,
    progress: Progress | None = None,
    stop: Stop | None = None,
) -> Outcome:
    """Run ``action`` over the tasks ``flt`` matches, ``batch`` rows per transaction, and record
    it in ``actions`` (by ``actor``, from ``source``): the row first, the counts so far with each
    batch (in its transaction), ``finished_at`` at the end. ``stop`` is asked before each batch:
    a reason (a signal's name) ends the action there, recorded as interrupted by it with the
    counts of the committed batches (``interrupted`` set, ``complete`` false); so does a batch
    cancelled while ``stop`` names one (it rolls back). Another error leaves ``finished_at`` NULL
    and is raised. Give a connection outside any transaction (or a pool or a DSN): in a caller's
    open transaction every batch would commit with it, as one."""
    out = _start(action, flt, dry_run=False, batch=batch)
    out.actor = clean(actor)[:ACTOR_CHARS] or "unknown"
    with borrow(target) as conn:
        out.action_id = record_action(
            conn,
            schema,
            actor=out.actor,
            action=action,
            filter=out.filter,
            source=source,
            finished=False,
        )
        action_id = out.action_id
        out.complete = False

        def record(counts: dict[str, Any]) -> None:
            finish_action(conn, schema, action_id, counts, finished=False)

        try:
            _walk(conn, schema, out, flt, batch, progress, keep=0, stop=stop, record=record)
            if out.interrupted is None:
                _count_running(conn, schema, out, flt)
                out.complete = True
        except psycopg.errors.QueryCanceled:
            reason = stop() if stop is not None else None
            if reason is None:
                raise
            out.interrupted = reason  # the batch in flight rolled back; the counts are the rest
        finally:
            with contextlib.suppress(psycopg.Error):
                finish_action(
                    conn,
                    schema,
                    action_id,
                    out.counts(),
                    finished=out.complete,
                    interrupted=out.interrupted,
                )
    return out


def _start(action: str, flt: Filter, *, dry_run: bool, batch: int) -> Outcome:
    if not 1 <= batch <= MAX_BATCH:
        raise BulkError(f"batch must be 1 to {MAX_BATCH:,}")
    flt.check()
    return Outcome(action, dry_run, _recorded_filter(flt), states_for(action, flt))


def _walk(
    conn: psycopg.Connection,
    schema: str,
    out: Outcome,
    flt: Filter,
    batch: int,
    progress: Progress | None,
    *,
    keep: int,
    stop: Stop | None = None,
    record: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Every batch of every walk, added up in ``out``. ``stop``: asked before each batch (a
    reason ends the walk there, in ``out.interrupted``). ``record``: given the counts with each
    batch, inside that batch's transaction, so that they commit (or roll back) together."""
    filter_json = flt.as_json()
    for walk in walks(out.states):
        cursor: Any = None
        while True:
            reason = stop() if stop is not None else None
            if reason is not None:
                out.interrupted = reason
                return
            with conn.transaction() if record is not None else contextlib.nullcontext():
                step = store.bulk_step(
                    conn,
                    schema,
                    action=out.action,
                    states=walk,
                    filter=filter_json,
                    cursor=cursor,
                    batch=batch,
                    dry_run=out.dry_run,
                )
                if record is not None:
                    record(_added(out, step).counts())
            # Only once the batch committed: the counts are those of the rows changed.
            out.batches += 1
            out.matched += step.matched
            out.changed += step.changed
            out.skipped_dedupe += len(step.skipped)
            out.skipped_dedupe_ids += step.skipped[: SKIPPED_SHOWN - len(out.skipped_dedupe_ids)]
            out.sample_ids += step.sample[: max(keep - len(out.sample_ids), 0)]
            if progress is not None:
                progress(out)
            if step.cursor is None:
                break
            cursor = step.cursor


def _added(out: Outcome, step: store.BulkStep) -> Outcome:
    """``out`` with ``step`` added to its counts (a copy: ``out`` changes once the step commits)."""
    return replace(
        out,
        batches=out.batches + 1,
        matched=out.matched + step.matched,
        changed=out.changed + step.changed,
        skipped_dedupe=out.skipped_dedupe + len(step.skipped),
    )


@dataclass
class Retried:
    """What ``retry_failed`` did."""

    requeued: int = 0
    skipped: int = 0  # their dedupe key is held by a scheduled, queued or running task
    skipped_ids: list[int] = field(default_factory=list)  # the first SKIPPED_SHOWN of them

    def as_dict(self) -> dict[str, Any]:
        return {
            "requeued": self.requeued,
            "skipped": {"dedupe_key_taken": self.skipped},
            "skipped_ids": self.skipped_ids,
        }


def retry_failed(
    conn: psycopg.Connection, schema: str, queue: str | None = None, *, batch: int = 1_000
) -> Retried:
    """Every task that failed before now (of ``queue``, or all) back to queued, ``batch`` rows per
    transaction, oldest failure first: a bulk retry of the failed state. A task whose dedupe key
    is taken stays failed and is counted in ``skipped``; the others are retried all the same."""
    out = _start("retry", Filter(queue=queue, states=("failed",)), dry_run=False, batch=batch)
    _walk(conn, schema, out, Filter(queue=queue, states=("failed",)), batch, None, keep=0)
    return Retried(out.changed, out.skipped_dedupe, out.skipped_dedupe_ids)


def walks(states: Iterable[str]) -> list[list[str]]:
    """The states as the batches walk them: done and cancelled together (one index holds both,
    schema/0008 bulk_walks), every other state alone; in the order given."""
    states = list(states)
    finished = [s for s in states if s in ("done", "cancelled")]
    out: list[list[str]] = []
    for s in states:
        if s not in finished:
            out.append([s])
        elif s == finished[0]:
            out.append(finished)
    return out


def _count_running(conn: psycopg.Connection, schema: str, out: Outcome, flt: Filter) -> None:
    """Running tasks the filter matches, for the actions whose user may expect them touched:
    cancel, and delete of tasks that have not finished."""
    if out.action != "cancel" and not set(out.states) & set(WAITING):
        return
    params = {"filter": Jsonb(flt.as_json()), "cap": RUNNING_CAP}
    rows = execute(conn, queries(schema)["bulk_running"], params)
    if rows:
        row = rows[0]
        out.running, out.running_ids = int(row[0]), list(row[1] or [])
        out.running_capped = out.running >= RUNNING_CAP


def _recorded_filter(flt: Filter) -> dict[str, Any]:
    """The filter as the record of the action keeps it: at most FILTER_IDS_KEPT ids, with their
    number."""
    data = flt.as_json()
    ids = data.get("ids")
    if ids and len(ids) > FILTER_IDS_KEPT:
        data["ids"], data["ids_total"] = ids[:FILTER_IDS_KEPT], len(ids)
    return data
