"""Transactional handlers: the handler runs inside the transaction that marks its task done, so
its own writes commit with the completion or not at all.

The runner thread (``engine.runners``) calls an ``InTransaction`` instead of the handler. It lends
a connection of the worker's pool (``HANDLERS``), runs the handler with ``ctx.conn`` set to it,
stores the result when the handler stores one, and completes the row through the store in the
same transaction, fenced on (worker id, attempt) like every acknowledgement. When the row is no
longer this worker's (its lease lapsed and it was rescued) or someone asked to cancel it, the
whole transaction rolls back: the handler's writes with it.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
from psycopg_pool import ConnectionPool

from .. import store
from ..errors import Cancelled, LostLease
from ..tasks import results
from ..tasks.registry import Context, TaskDef
from .job import Job, MissedStart, missed_start

MakeContext = Callable[[Job, psycopg.Connection | None], Context]


class InTransaction:
    """Run a transactional job: see the module's docstring."""

    def __init__(
        self,
        pool: Callable[[], ConnectionPool | None],
        *,
        schema: str,
        worker_id: str,
        context: MakeContext,
        stores_result: Callable[[TaskDef], bool],
        max_result_bytes: int,
        move: bool = False,
    ) -> None:
        self._pool = pool
        self.schema = schema
        self.worker_id = worker_id
        self._context = context
        self._stores_result = stores_result
        self._max_result_bytes = max_result_bytes
        self._done_channel = results.done_channel(schema)
        self._move = move  # done rows go to the history (schema/0025, keep_history)

    def __call__(self, job: Job) -> None:
        """Raises ``LostLease`` or ``Cancelled`` (after the rollback) when the row could not be
        completed; the failure then goes through the usual acknowledgement, which ends a row
        with a cancel request cancelled."""
        pool = self._pool()
        assert pool is not None
        c = job.claimed
        with pool.connection() as conn, conn.transaction():
            # A rate limit's pace was checked before the connection was lent and the transaction
            # begun, which may take long (a pool without a free connection, a server coming back):
            # past its moment's slack, the handler must not start (the runner gives it back).
            if missed_start(job):
                raise MissedStart(f"task {c.id}: its transaction opened past its paced start")
            value = job.definition.fn(job.payload, self._context(job, conn))
            if self._stores_result(job.definition) or c.dependents:
                # A result that cannot be stored raises here (a DoNotRetry), rolling back the
                # handler's writes with the completion.
                text = results.encode_result(value, self._max_result_bytes)
                row = [(c.id, c.attempt, text)]
                kept = store.complete_with_result(
                    conn, self.schema, worker_id=self.worker_id, done=row, move=self._move
                )
                if kept:
                    store.notify_done(conn, self.schema, channel=self._done_channel, ids=kept)
            else:
                done = [(c.id, c.attempt)]
                kept = store.complete(
                    conn, self.schema, worker_id=self.worker_id, done=done, move=self._move
                )
            if c.dependents and c.id in kept:  # a workflow's step: its dependents, at once
                store.settle_steps(conn, self.schema, [c.id])
            if c.id not in kept:
                raise LostLease(
                    f"task {c.id} was rescued while its handler ran; its writes are rolled back"
                )
            if kept[c.id] == "cancelled":
                raise Cancelled(
                    f"task {c.id} was cancelled while its handler ran; its writes are rolled back"
                )


__all__ = ["InTransaction"]
