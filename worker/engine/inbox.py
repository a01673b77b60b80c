"""The main loop's inbox: what the worker's other threads report, and the notifications that
reach the claim connection, waited for together.

The loop sleeps in one ``poll`` on two descriptors: a pipe that ``put`` writes to while the loop
sleeps, and, when the claim connection listens (``listen``), that connection's socket, where
NOTIFY lands. So a notification wakes the thread that claims, with no listener thread and no
hand-over between threads on the way, and a worker process keeps one connection fewer.
Notifications that arrive while a statement runs are taken by psycopg as it reads the results,
and are handed to the same callbacks.

Where the claim connection cannot LISTEN (behind PgBouncer in transaction mode, with a
``listen_dsn``), ``engine.listener``'s thread listens on a connection of its own and ``put``s here
like any other thread. If the listening connection breaks while the loop sleeps, the inbox closes it
and reports it lost once (``on_lost``); the worker then connects again, and ``listen`` calls every
callback with None, since notifications may have been sent while nobody listened."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue as queue_mod
import select
import threading
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg import sql

log = logging.getLogger("worker")

Callback = Callable[[str | None], None]

# Longest a busy loop (no free slots) goes without reading the socket: how late a cancel request
# can be heard while every slot runs a long task.
BUSY_LOOK = 0.02


class Inbox:
    def __init__(self) -> None:
        self._q: queue_mod.SimpleQueue[Any] = queue_mod.SimpleQueue()
        # After get or get_nowait: the reports queued since, with nothing else looked at (the
        # loop takes a busy drain's outcomes with it, one C call each).
        self.more = self._q.get_nowait
        self._r = self._w = -1  # the wake-up pipe, made by the first listen
        self._closed = False
        self._sleeping = False
        self._pipe_lock = threading.Lock()  # no write to a pipe being closed (see close)
        self._conn: psycopg.Connection | None = None
        self._poller: Any = None  # select.poll over the pipe and the listening socket
        self._sock = -1
        self._channels: dict[str, Callback] = {}
        self._on_lost: Callable[[], None] = lambda: None

    # -- any thread ------------------------------------------------------------------------------

    def put(self, item: Any) -> None:
        self._q.put(item)
        # Read after the item is queued: a loop that set the flag after this read finds the item
        # when it looks again before sleeping (see get). The first put to find it asleep wakes
        # it and clears the flag, so a burst of reports costs one write, not one each.
        if self._sleeping:
            with self._pipe_lock:
                if self._sleeping and self._w >= 0:
                    self._sleeping = False
                    with contextlib.suppress(BlockingIOError):  # a full pipe wakes it anyway
                        os.write(self._w, b"\0")

    @property
    def listening(self) -> bool:
        """Whether the claim connection has its LISTEN in place right now."""
        conn = self._conn
        return conn is not None and not conn.closed

    # -- the main thread -------------------------------------------------------------------------

    def listen(
        self,
        conn: psycopg.Connection,
        channels: Mapping[str, Callback],
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        """LISTEN on ``conn`` (autocommit, idle), which the main thread uses for its statements."""
        with self._pipe_lock:
            if self._r < 0 and not self._closed:
                self._r, self._w = os.pipe()
                os.set_blocking(self._r, False)
                os.set_blocking(self._w, False)
        self._channels = dict(channels)
        self._on_lost = on_lost
        if self._conn is not conn:
            conn.add_notify_handler(self._notified)  # before LISTEN: none goes elsewhere
        for channel in channels:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        # poll, not select: a process with over a thousand files open (an application hosting
        # a background worker, say) gives its sockets numbers that select cannot watch.
        self._sock = conn.pgconn.socket
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        if self._r >= 0:
            self._poller.register(self._r, select.POLLIN)
        self._conn = conn
        for callback in self._channels.values():
            callback(None)  # something may have come while we were not listening

    def get_nowait(self) -> Any:
        """The next report, or ``queue.Empty``. Notifications libpq has already read are handed
        to their callbacks first (which queue them behind the reports already there)."""
        if self._conn is not None:
            self._take()
        return self._q.get_nowait()

    def get(self, timeout: float, *, busy: bool = False) -> Any:
        """The next report, waiting up to ``timeout`` seconds; ``queue.Empty`` if none came.

        ``busy``: the loop cannot claim now (its slots are taken), so a new row can wait; only
        a cancel request should not. It then waits on the queue alone, as cheaply as a thread
        can, for at most BUSY_LOOK seconds, and looks at the socket only if nothing came: a busy
        drain, where runners report many times a second, never pays for the socket; a worker
        whose slots all run long tasks sleeps on both after that, as an idle one does."""
        with contextlib.suppress(queue_mod.Empty):
            return self.get_nowait()
        conn = self._conn
        if conn is None or conn.closed or self._r < 0:
            return self._q.get(timeout=timeout)
        if busy:
            try:
                return self._q.get(timeout=min(timeout, BUSY_LOOK))
            except queue_mod.Empty:
                timeout = max(timeout - BUSY_LOOK, 0.0)
        self._sleeping = True
        try:
            try:
                return self._q.get_nowait()  # put between the two looks: it did not write
            except queue_mod.Empty:
                pass
            try:
                ready = dict(self._poller.poll(math.ceil(timeout * 1000)))
            except OSError:
                ready = {self._sock: select.POLLNVAL}
        finally:
            self._sleeping = False
        if self._r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._r, 4096)
        flags = ready.get(self._sock, 0)
        if flags & select.POLLNVAL:  # the socket was closed under us
            self._drop(conn)
        elif flags and not conn.closed:
            try:
                conn.pgconn.consume_input()
            except psycopg.Error:
                self._drop(conn)
            else:
                if conn.pgconn.status != psycopg.pq.ConnStatus.OK:
                    self._drop(conn)
        return self.get_nowait()

    def close(self) -> None:
        """After the loop: runners that still finish may put, and must not write to a number
        the process has given to another file since."""
        with self._pipe_lock:
            self._closed = True
            for fd in (self._r, self._w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._r = self._w = -1

    def _take(self) -> None:
        """Hand the notifications libpq has read to their callbacks (no I/O)."""
        conn = self._conn
        if conn is None or conn.closed:
            return
        pgconn = conn.pgconn
        # psycopg sets this on every connection (3.1 to 3.3 at least) to decode a notification
        # and call the handlers added by add_notify_handler, here _notified; it calls it the same
        # way itself for notifications it reads with results (tests/test_inbox.py checks both).
        handler = pgconn.notify_handler
        while (note := pgconn.notifies()) is not None:
            if handler is not None:
                handler(note)

    def _notified(self, note: psycopg.Notify) -> None:
        callback = self._channels.get(note.channel)
        if callback is not None:
            callback(note.payload)

    def _drop(self, conn: psycopg.Connection) -> None:
        """The listening connection broke while idle: close it (the next statement connects
        again, and listens) and say so once."""
        log.info("the claim connection was lost while waiting for notifications; reconnecting")
        with contextlib.suppress(Exception):
            conn.close()
        if self._conn is conn:
            self._conn = None
            self._on_lost()


__all__ = ["Inbox"]
