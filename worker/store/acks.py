"""Acknowledgements: a worker's finished tasks leave ``in_progress`` (``complete``, ``fail``,
``hand_back``, ``release``), fenced on (worker id, attempt), and the leases of running ones are
renewed (``heartbeat``). Every function runs one statement for a whole batch (those that end
rows done, one per piece of it: see ACK_PIECE); none is called per task on the hot path.

Every statement is in ``acks.sql`` beside this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from ..db.arrays import PLAN_EACH, int_array, text_array
from .statements import statements

# pg_notify refuses payloads of 8,000 bytes or more; ids are sent in pieces below that.
_NOTIFY_BYTES = 7900

# Each task keeps the errors of its last ERROR_HISTORY attempts (column `errors`, schema/0008),
# each cut to ERROR_HISTORY_CHARS characters; last_error keeps the latest in full.
ERROR_HISTORY = 10

ERROR_HISTORY_CHARS = 2000

HISTORY = {"history": ERROR_HISTORY, "history_chars": ERROR_HISTORY_CHARS}

# The statements that end rows done (complete, complete_delete, complete_move,
# complete_with_result, complete_steps) are prepared, and find each row's attempt by its
# position in the batch: a pass over the batch per row (see complete in acks.sql). Batches go
# in pieces of at most this many rows, where the passes cost less than planning the statement
# did; a workflow's steps excepted (see complete_steps). No piece holds one task twice: a
# batch may hold the outcome of a cancelled attempt not yet acknowledged and the outcome of the
# same task claimed again by this worker, and the position of the first would fence the second.
ACK_PIECE = 100


@dataclass(slots=True)
class Failure:
    id: int
    attempt: int
    delay: float
    error: str
    permanent: bool
    # The handler's max_attempts, for a row whose producer left it to the handler and that no
    # claim filled in (a handler loaded on demand after the claim).
    max_attempts: int | None = None


def complete(
    conn: psycopg.Connection,
    schema: str,
    *,
    worker_id: str,
    done: Sequence[tuple[int, int]],
    delete: bool = False,
    move: bool = False,
) -> dict[int, str]:
    """in_progress -> done (or deleted, with ``delete``; or moved to the history, with
    ``move``: schema/0025), or cancelled for rows someone asked to cancel. Returns
    {id: "done" | "cancelled"} for the rows that were still ours (a deleted or moved row counts
    as done)."""
    if not done:
        return {}
    if _split(done):
        return _in_pieces(complete, conn, schema, worker_id, done, delete=delete, move=move)
    ids, attempts = zip(*done, strict=True)
    params: dict[str, str | None] = {
        "ids": int_array(ids),
        "attempts": int_array(attempts),
        "worker_id": worker_id,
    }
    if not delete and not move:
        return dict(conn.execute(statements(schema)["complete"], params).fetchall())
    if delete:
        gone = conn.execute(statements(schema)["complete_delete"], params).fetchall()
    else:
        params["results"] = None  # nothing to store: each row keeps its own (see complete_move)
        gone = conn.execute(statements(schema)["complete_move"], params).fetchall()
    kept = {r[0]: "done" for r in gone}
    if len(kept) < len(ids):
        # Cron rows are kept (their slot must stay taken), and so are rows with a cancel request
        # (they end cancelled) and workflow steps: mark those instead.
        rest = [(i, a) for i, a in done if i not in kept]
        kept |= complete(conn, schema, worker_id=worker_id, done=rest)
    return kept


def fail(
    conn: psycopg.Connection, schema: str, *, worker_id: str, failures: Sequence[Failure]
) -> dict[int, str]:
    """in_progress -> queued (later) or failed, each error appended to the row's history (the
    last ERROR_HISTORY kept). Returns {id: new state} for rows still ours."""
    if not failures:
        return {}
    rows = conn.execute(
        statements(schema)["retry"],
        {
            "ids": int_array(f.id for f in failures),
            "attempts": int_array(f.attempt for f in failures),
            "delays": [f.delay for f in failures],
            "errors": [f.error for f in failures],
            "permanent": [f.permanent for f in failures],
            "max_attempts": int_array(f.max_attempts or 0 for f in failures),
            "worker_id": worker_id,
            **HISTORY,
        },
        **PLAN_EACH,
    ).fetchall()
    return {r[0]: r[1] for r in rows}


def hand_back(
    conn: psycopg.Connection,
    schema: str,
    *,
    worker_id: str,
    rows: Sequence[tuple[int, int, str]],
) -> dict[int, str]:
    """in_progress -> scheduled, uncounted, for rows of tasks this worker has no handler for:
    (id, attempt, error) each; cancelled for rows with a cancel request. Returns {id: new state}
    for the rows still ours."""
    if not rows:
        return {}
    ids, attempts, errors = zip(*rows, strict=True)
    found = conn.execute(
        statements(schema)["hand_back"],
        {
            "ids": int_array(ids),
            "attempts": int_array(attempts),
            "errors": list(errors),
            "worker_id": worker_id,
            **HISTORY,
        },
        **PLAN_EACH,
    ).fetchall()
    return dict(found)


def release(
    conn: psycopg.Connection, schema: str, *, worker_id: str, tasks: Sequence[tuple[int, int]]
) -> dict[int, str]:
    """in_progress -> queued, attempt not counted: for tasks a stopping worker gives back
    (cancelled for rows with a cancel request). Returns {id: new state} for the rows still
    ours."""
    if not tasks:
        return {}
    ids, attempts = zip(*tasks, strict=True)
    rows = conn.execute(
        statements(schema)["release"],
        {"ids": int_array(ids), "attempts": int_array(attempts), "worker_id": worker_id},
        **PLAN_EACH,
    ).fetchall()
    return {r[0]: r[1] for r in rows}


@dataclass(slots=True)
class Beat:
    """What a heartbeat found: rows lost, and rows someone asked to cancel."""

    lost: set[tuple[int, int]]  # (id, attempt): another owner, another attempt, or not running
    cancel: set[int]  # ids of renewed rows with a cancel request (schema/0010)


def heartbeat(
    conn: psycopg.Connection,
    schema: str,
    *,
    worker_id: str,
    tasks: Sequence[tuple[int, int]],
    lease_seconds: float,
) -> Beat:
    """Renew the leases of (id, attempt) rows still ours, and the worker's own row; says which
    rows are lost and which of the renewed ones have a cancel request. Waits on no lock."""
    rows = conn.execute(
        statements(schema)["heartbeat"],
        {
            "ids": int_array(i for i, _ in tasks),
            "attempts": int_array(a for _, a in tasks),
            "worker_id": worker_id,
            "lease_seconds": lease_seconds,
        },
        **PLAN_EACH,
    ).fetchall()
    return Beat({(r[0], r[1]) for r in rows if not r[2]}, {r[0] for r in rows if r[2]})


def complete_with_result(
    conn: psycopg.Connection,
    schema: str,
    *,
    worker_id: str,
    done: Sequence[tuple[int, int, str]],
    move: bool = False,
) -> dict[int, str]:
    """in_progress -> done, storing each row's result: (id, attempt, result JSON) each, fenced
    as ``complete`` (a row with a cancel request ends cancelled, without its
    result); with ``move``, the rows ``complete_move`` takes go to the history with their
    result. Returns {id: "done" | "cancelled"} for the rows that were still ours."""
    if not done:
        return {}
    if _split(done):
        return _in_pieces(complete_with_result, conn, schema, worker_id, done, move=move)
    params = _with_results(done, worker_id)
    kept: dict[int, str] = {}
    if move:
        moved = conn.execute(statements(schema)["complete_move"], params).fetchall()
        kept = {r[0]: "done" for r in moved}
        if len(kept) == len(done):
            return kept
        rest = [row for row in done if row[0] not in kept]
        return kept | complete_with_result(conn, schema, worker_id=worker_id, done=rest)
    rows = conn.execute(statements(schema)["complete_with_result"], params).fetchall()
    return {r[0]: r[1] for r in rows}


def _with_results(done: Sequence[tuple[int, int, str]], worker_id: str) -> dict[str, Any]:
    """The parameters of the statements that store results: (id, attempt, result JSON) each."""
    ids, attempts, results = zip(*done, strict=True)
    return {
        "ids": int_array(ids),
        "attempts": int_array(attempts),
        # As text: psycopg adapts a list of a hundred strings in about 250 µs (see int_array).
        "results": text_array(results),
        "worker_id": worker_id,
    }


def complete_steps(
    conn: psycopg.Connection,
    schema: str,
    *,
    worker_id: str,
    done: Sequence[tuple[int, int, str]],
    quiet: Sequence[str] = (),
) -> tuple[dict[int, str], list[str]]:
    """Workflows: ``complete_with_result`` for steps that others wait for, settling their
    dependents in the same statement (see complete_steps in acks.sql). Returns ({id: "done" |
    "cancelled"} for the rows that were still ours, the queues where dependents became
    runnable); those in ``quiet`` are not woken (see settle_steps)."""
    if not done:
        return {}, []
    # One statement whatever the batch's size, not pieces of ACK_PIECE rows: the settlement
    # locks the dependents in id order within a statement, and two workers whose pieces locked
    # the joins of a fan-in in different orders would deadlock. A batch that holds a step twice
    # (see ACK_PIECE) is acknowledged in pieces that lock only the steps' own rows, and its
    # dependents are settled after, in one statement.
    if _repeats(done):
        kept = complete_with_result(conn, schema, worker_id=worker_id, done=done)
        return kept, settle_steps(conn, schema, sorted(kept), quiet=quiet)
    params = {**_with_results(done, worker_id), "quiet": text_array(quiet)}
    rows = conn.execute(statements(schema)["complete_steps"], params).fetchall()
    return {r[0]: r[1] for r in rows}, list(rows[0][3] or []) if rows else []


def settle_steps(
    conn: psycopg.Connection, schema: str, ids: Sequence[int], *, quiet: Sequence[str] = ()
) -> list[str]:
    """Workflows: settle the dependents of these just-acknowledged steps (those with dependents
    that ended done, failed or cancelled; the others are passed over), in the caller's
    transaction. Returns the queues where dependents became runnable. Those in ``quiet`` are
    not woken: the caller claims in them next, and calls ``wake_queues`` for any its claim may
    have left a ready step in."""
    if not ids:
        return []
    params = {"ids": int_array(ids), "quiet": text_array(quiet)}
    row = conn.execute(statements(schema)["settle_steps"], params, **PLAN_EACH).fetchone()
    return list(row[1] or []) if row else []


def wake_queues(conn: psycopg.Connection, schema: str, queues: Sequence[str]) -> None:
    """Wake the workers of these queues when the caller's transaction commits."""
    if queues:
        conn.execute(statements(schema)["wake_queues"], {"queues": text_array(queues)})


def notify_done(conn: psycopg.Connection, schema: str, *, channel: str, ids: Iterable[int]) -> None:
    """Announce finished tasks on ``channel``, in as few notifications as fit (see notify_done
    in acks.sql). Delivered when the caller's transaction commits."""
    for payload in _pieces([str(int(i)) for i in ids]):
        conn.execute(statements(schema)["notify_done"], {"channel": channel, "ids": payload})


def _in_pieces(
    ack: Callable[..., dict[int, str]],
    conn: psycopg.Connection,
    schema: str,
    worker_id: str,
    done: Sequence[Any],
    **options: bool,
) -> dict[int, str]:
    """``ack`` over the batch in pieces of at most ACK_PIECE rows, none holding a task twice,
    its answers merged. A task's first outcome in the batch goes in the first pieces, its second
    in the pieces after them, and so on; at most one of them is at the row's attempt."""
    layers: list[list[Any]] = []
    seen: dict[int, int] = {}
    for row in done:
        n = seen.get(row[0], 0)
        seen[row[0]] = n + 1
        if n == len(layers):
            layers.append([])
        layers[n].append(row)
    kept: dict[int, str] = {}
    for layer in layers:
        for i in range(0, len(layer), ACK_PIECE):
            piece = layer[i : i + ACK_PIECE]
            kept |= ack(conn, schema, worker_id=worker_id, done=piece, **options)
    return kept


def _repeats(done: Sequence[Any]) -> bool:
    """Whether the batch holds a task twice."""
    return len({row[0] for row in done}) < len(done)


def _split(done: Sequence[Any]) -> bool:
    """Whether the batch goes in pieces (see ACK_PIECE)."""
    return len(done) > ACK_PIECE or _repeats(done)


def _pieces(ids: list[str]) -> list[str]:
    out: list[str] = []
    current: list[str] = []
    size = 0
    for text in ids:
        if current and size + len(text) + 1 > _NOTIFY_BYTES:
            out.append(",".join(current))
            current, size = [], 0
        current.append(text)
        size += len(text) + 1
    if current:
        out.append(",".join(current))
    return out
