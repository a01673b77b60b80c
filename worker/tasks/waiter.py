"""``Waiter``: any number of waits, from any number of threads or event loops, over one
connection and one thread.

The thread listens on ``<schema>.done`` (see tasks.results), reads the rows of the tasks named by
each notification, and those of every task waited on once per ``poll_interval`` (tasks that send no
notification: see tasks.wait), and settles the futures of their waits. Two thousand waits cost one
connection and one statement per notification or poll, not two thousand of either."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import psycopg

from ..db.arrays import int_array
from ..db.connect import WAIT, Backoff, connect
from ..db.sql import Queries, queries
from ..errors import WaitTimeout, WorkerError
from .results import done_channel
from .wait import check_args, listen_statement, settle

log = logging.getLogger("worker")

# How long the thread listens before it looks at waits registered meanwhile.
_TICK = 0.05
# Ids per read of task_outcomes.
_READ_BATCH = 5000


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
        check_args(None, poll_interval)
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
        check_args(timeout, self.poll_interval)
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
        check_args(timeout, self.poll_interval)
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
        check_args(timeout, self.poll_interval)
        f = self.future(task_id)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(f), timeout)
        except TimeoutError:
            f.cancel()
            raise WaitTimeout(int(task_id), timeout or 0.0) from None

    # -- the thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        backoff = Backoff(0.2, 2.0)
        while not self._stop.is_set():
            try:
                # Never prepared (WAIT): PgBouncer in transaction mode cannot keep them.
                duty = replace(WAIT, name=self.application_name, connect_timeout=5)
                with connect(self.dsn, duty, session=False) as conn:
                    if self.listen:
                        conn.execute(listen_statement(self.channel))
                    backoff.reset()
                    self._serve(conn)
            except psycopg.Error as exc:
                log.info("waiter disconnected (%s); reconnecting", type(exc).__name__)
                self._stop.wait(backoff.next())

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


__all__ = ["Waiter"]
