"""Waiting for tasks to finish: ``wait``, ``wait_async``, and ``Waiter`` for many at once.

A wait reads the task's row (``task_outcomes``) and returns its stored result when it is done, or
raises ``TaskFailed``, ``TaskCancelled`` or ``TaskNotFound``; ``WaitTimeout`` when the timeout
passes first. Between two reads it listens on ``<schema>.done``, where the transaction that
finishes a task storing a result announces it (see _results), so it wakes as that transaction
commits; it also reads again every ``poll_interval`` seconds, which is how it learns of tasks
that send no notification (those that store no result, cancellations, rescues that fail a row).
Behind PgBouncer in transaction mode LISTEN hears nothing: pass ``listen=False`` (poll only), or
give the waiter a direct connection.

``wait`` holds one connection for the whole wait. ``Waiter`` serves any number of waits, from
any number of threads or event loops, with one connection and one thread: it listens, reads the
rows of the tasks named by each notification (and all of them at each poll), and settles their
futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from ._conn import Target, borrow
from ._errors import TaskCancelled, TaskFailed, TaskNotFound, WaitTimeout, WorkerError
from ._results import done_channel
from ._sql import Queries, queries
from ._transitions import int_array

log = logging.getLogger("worker")

# How long the Waiter's thread listens before it looks at waits registered meanwhile.
_TICK = 0.05
# Ids per read of task_outcomes.
_READ_BATCH = 5000

AsyncTarget = psycopg.AsyncConnection | AsyncConnectionPool | str


def settle(task_id: int, row: Sequence[Any] | None) -> tuple[bool, Any]:
    """(finished, result) from a row of ``task_outcomes`` (None: no such row); raises for a task
    that ended without a result to give."""
    if row is None:
        raise TaskNotFound(task_id)
    state = row[1]
    if state == "done":
        return True, row[2]
    if state == "failed":
        raise TaskFailed(task_id, row[3])
    if state == "cancelled":
        raise TaskCancelled(task_id)
    return False, None


def _check_args(timeout: float | None, poll_interval: float) -> None:
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, not {timeout!r}")
    if not (math.isfinite(poll_interval) and poll_interval > 0):
        raise ValueError(f"poll_interval must be a positive number of seconds, not {poll_interval}")


def _listen(channel: str, on: bool = True) -> sql.Composed:
    # LISTEN takes no parameters; the channel is a validated schema name plus ".done", quoted.
    return sql.SQL("LISTEN {}" if on else "UNLISTEN {}").format(sql.Identifier(channel))


def _run(
    conn: psycopg.Connection, query: Any, params: Mapping[str, Any] | None = None
) -> list[Any]:
    """One statement committed at once: the caller's connection must not be in a transaction
    (see _idle), so a non-autocommit one gets a transaction of its own per statement."""
    ctx = contextlib.nullcontext() if conn.autocommit else conn.transaction()
    with ctx:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def _idle(status: psycopg.pq.TransactionStatus) -> None:
    if status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError(
            "wait needs a connection outside any transaction: inside one it would not see the "
            "task finish (and a task enqueued in that transaction cannot even start)"
        )


def _mentions(payload: str, task_id: int) -> bool:
    return str(task_id) in payload.split(",")


def _left(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.monotonic()


def wait(
    target: Target,
    task_id: int,
    *,
    timeout: float | None = None,
    schema: str = "worker",
    poll_interval: float = 1.0,
    listen: bool = True,
) -> Any:
    """Block until task ``task_id`` finishes; return its stored result (None when it stores
    none). ``target``: a connection (autocommit, or at least not inside a transaction), a pool,
    or a DSN. Raises TaskFailed, TaskCancelled, TaskNotFound, or WaitTimeout after ``timeout``
    seconds (None: no limit)."""
    _check_args(timeout, poll_interval)
    q, channel = queries(schema), done_channel(schema)
    deadline = None if timeout is None else time.monotonic() + timeout
    with borrow(target) as conn:
        _idle(conn.info.transaction_status)
        if listen:
            _run(conn, _listen(channel))  # before the first read: no notification slips past
        try:
            while True:
                rows = _run(conn, q["task_outcomes"], {"ids": int_array([task_id])})
                finished, result = settle(task_id, rows[0] if rows else None)
                if finished:
                    return result
                left = _left(deadline)
                if left <= 0:
                    raise WaitTimeout(task_id, timeout or 0.0)
                pause = min(poll_interval, left)
                if not listen:
                    time.sleep(pause)
                    continue
                for note in conn.notifies(timeout=pause):
                    if _mentions(note.payload, task_id):
                        break
        finally:
            if listen and not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    _run(conn, _listen(channel, on=False))


@contextlib.asynccontextmanager
async def _borrow_async(target: AsyncTarget) -> AsyncIterator[psycopg.AsyncConnection]:
    if isinstance(target, str):
        conn = await psycopg.AsyncConnection.connect(target, autocommit=True, connect_timeout=10)
        async with conn:
            yield conn
    elif isinstance(target, AsyncConnectionPool):
        async with target.connection() as conn:
            yield conn
    else:
        yield target


async def _run_async(
    conn: psycopg.AsyncConnection, query: Any, params: Mapping[str, Any] | None = None
) -> list[Any]:
    ctx = contextlib.nullcontext() if conn.autocommit else conn.transaction()
    async with ctx:  # type: ignore[attr-defined]
        cur = await conn.execute(query, params)
        return await cur.fetchall() if cur.description else []


async def wait_async(
    target: AsyncTarget,
    task_id: int,
    *,
    timeout: float | None = None,
    schema: str = "worker",
    poll_interval: float = 1.0,
    listen: bool = True,
) -> Any:
    """``wait`` for asyncio: an AsyncConnection, an AsyncConnectionPool or a DSN."""
    _check_args(timeout, poll_interval)
    q, channel = queries(schema), done_channel(schema)
    deadline = None if timeout is None else time.monotonic() + timeout
    async with _borrow_async(target) as conn:
        _idle(conn.info.transaction_status)
        if listen:
            await _run_async(conn, _listen(channel))
        try:
            while True:
                rows = await _run_async(conn, q["task_outcomes"], {"ids": int_array([task_id])})
                finished, result = settle(task_id, rows[0] if rows else None)
                if finished:
                    return result
                left = _left(deadline)
                if left <= 0:
                    raise WaitTimeout(task_id, timeout or 0.0)
                pause = min(poll_interval, left)
                if not listen:
                    await asyncio.sleep(pause)
                    continue
                async for note in conn.notifies(timeout=pause):
                    if _mentions(note.payload, task_id):
                        break
        finally:
            if listen and not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    await _run_async(conn, _listen(channel, on=False))


class Waiter:
    """Many waits over one connection: a thread listens on ``<schema>.done``, reads the rows of
    the tasks it hears of (and of every task waited on, each ``poll_interval``), and settles the
    futures of their waits. Thread-safe; usable from asyncio (``wait_async``).

    ``dsn``: the waiter opens its own connection (named ``application_name``) and reconnects on
    its own after an error; waits in progress carry on meanwhile, with their timeouts.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "worker",
        poll_interval: float = 1.0,
        listen: bool = True,
        application_name: str = "worker-waiter",
    ) -> None:
        _check_args(None, poll_interval)
        self.dsn = dsn
        self.q: Queries = queries(schema)
        self.channel = done_channel(schema)
        self.poll_interval = poll_interval
        self.listen = listen
        self.application_name = application_name
        self._lock = threading.Lock()
        self._pending: dict[int, list[concurrent.futures.Future[Any]]] = {}
        self._new: set[int] = set()  # registered since the thread last looked
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Waiter:
        with self._lock:
            if self._thread is None:
                if self._stop.is_set():
                    raise WorkerError("this Waiter is closed")
                self._thread = threading.Thread(
                    target=self._loop, name="worker-waiter", daemon=True
                )
                self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; waits still pending are cancelled."""
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            pending, self._pending = self._pending, {}
        for futures in pending.values():
            for f in futures:
                f.cancel()

    def __enter__(self) -> Waiter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- waits -----------------------------------------------------------------------------------

    def future(self, task_id: int) -> concurrent.futures.Future[Any]:
        """A future settled when the task finishes: its result, or TaskFailed, TaskCancelled,
        TaskNotFound. Cancel it to stop waiting."""
        task_id = int(task_id)
        self.start()
        f: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._pending.setdefault(task_id, []).append(f)
            self._new.add(task_id)
        self._kick.set()
        return f

    def wait(self, task_id: int, timeout: float | None = None) -> Any:
        """The task's result (see ``worker.wait``)."""
        _check_args(timeout, self.poll_interval)
        f = self.future(task_id)
        try:
            return f.result(timeout)
        except concurrent.futures.TimeoutError:
            f.cancel()
            raise WaitTimeout(int(task_id), timeout or 0.0) from None

    def wait_many(
        self,
        ids: Iterable[int],
        timeout: float | None = None,
        *,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """The results of ``ids``, in their order, all within one ``timeout``. The first task
        that failed, was cancelled, or timed out raises, unless ``return_exceptions``: then its
        exception takes its place in the list."""
        _check_args(timeout, self.poll_interval)
        ids = [int(i) for i in ids]
        futures = [self.future(i) for i in ids]
        concurrent.futures.wait(futures, timeout)
        out: list[Any] = []
        for task_id, f in zip(ids, futures, strict=True):
            if not f.done():
                f.cancel()
                out.append(WaitTimeout(task_id, timeout or 0.0))
            elif f.cancelled():
                out.append(WorkerError(f"the wait for task {task_id} was cancelled"))
            else:
                exc = f.exception()
                out.append(exc if exc is not None else f.result())
        if not return_exceptions:
            for value in out:
                if isinstance(value, BaseException):
                    raise value
        return out

    async def wait_async(self, task_id: int, timeout: float | None = None) -> Any:
        """``wait`` from asyncio: the event loop is never blocked."""
        _check_args(timeout, self.poll_interval)
        f = self.future(task_id)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(f), timeout)
        except TimeoutError:
            f.cancel()
            raise WaitTimeout(int(task_id), timeout or 0.0) from None

    # -- the thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    self.dsn,
                    autocommit=True,
                    connect_timeout=5,
                    application_name=self.application_name,
                ) as conn:
                    if self.listen:
                        conn.execute(_listen(self.channel))
                    backoff = 0.2
                    self._serve(conn)
            except psycopg.Error as exc:
                log.info("waiter disconnected (%s); reconnecting", type(exc).__name__)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def _serve(self, conn: psycopg.Connection) -> None:
        next_poll = 0.0  # (re)connected: anything may have finished meanwhile
        while not self._stop.is_set():
            heard: set[int] = set()
            if self.listen:
                for note in conn.notifies(timeout=_TICK):
                    heard.update(int(i) for i in note.payload.split(",") if i.isdigit())
            else:
                self._kick.wait(_TICK)
            self._kick.clear()
            now = time.monotonic()
            with self._lock:
                fresh, self._new = self._new, set()
                if now >= next_poll:
                    ids = self._prune()
                    next_poll = now + self.poll_interval
                else:
                    ids = fresh | (heard & self._pending.keys())
            if ids:
                self._read(conn, sorted(ids))

    def _prune(self) -> set[int]:
        """Under the lock: drop cancelled waits; the ids still waited on."""
        for task_id in list(self._pending):
            alive = [f for f in self._pending[task_id] if not f.cancelled()]
            if alive:
                self._pending[task_id] = alive
            else:
                del self._pending[task_id]
        return set(self._pending)

    def _read(self, conn: psycopg.Connection, ids: list[int]) -> None:
        for start in range(0, len(ids), _READ_BATCH):
            chunk = ids[start : start + _READ_BATCH]
            found = {
                r[0]: r
                for r in conn.execute(self.q["task_outcomes"], {"ids": int_array(chunk)}).fetchall()
            }
            for task_id in chunk:
                try:
                    finished, result = settle(task_id, found.get(task_id))
                except WorkerError as exc:
                    self._settle(task_id, error=exc)
                    continue
                if finished:
                    self._settle(task_id, result=result)

    def _settle(
        self, task_id: int, *, result: Any = None, error: BaseException | None = None
    ) -> None:
        with self._lock:
            futures = self._pending.pop(task_id, [])
        for f in futures:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled
                if error is not None:
                    f.set_exception(error)
                else:
                    f.set_result(result)


__all__ = ["Waiter", "settle", "wait", "wait_async"]
