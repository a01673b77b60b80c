"""The listener: a thread with a connection of its own that turns NOTIFY into a wake-up.

Optional: without it a worker polls. Behind PgBouncer in transaction mode LISTEN needs a direct
connection (``listen_dsn``). After a reconnection it wakes the worker once, since rows may have
come while nobody listened.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg
from psycopg import sql

log = logging.getLogger("worker")


class Listener:
    def __init__(self, dsn: str, channel: str, wake: Callable[[str | None], None]) -> None:
        self.dsn = dsn
        self.channel = channel
        self._wake = wake
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="worker-listen", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        channel = sql.Identifier(self.channel)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(channel))
                    backoff = 0.5
                    self._wake(None)  # rows may have come while we were not listening
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5, stop_after=1):
                            self._wake(note.payload)  # the queues that got rows
            except psycopg.Error as exc:
                log.info(
                    "listener disconnected (%s); polling until it reconnects", type(exc).__name__
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)


__all__ = ["Listener"]
