"""The listener: a thread with a connection of its own that turns NOTIFY into wake-ups.

Only behind PgBouncer in transaction mode, where LISTEN needs a direct connection (``listen_dsn``);
otherwise the main loop listens on its claim connection (``engine.inbox``), and without either a
worker polls. It listens on one or more channels, each with its own callback (new rows, and cancel
requests: see ``coord.cancel``). After a (re)connection it calls every callback once with None,
since notifications may have been sent while nobody listened; ``connected`` says whether LISTEN is
in place right now, so that others can poll while it is not."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import psycopg
from psycopg import sql

from ..db.connect import LISTEN, Backoff, connect
from ..db.outage import OUTAGE, unreachable

log = logging.getLogger("worker")

Callback = Callable[[str | None], None]


class Listener:
    def __init__(self, dsn: str, channels: Mapping[str, Callback]) -> None:
        self.dsn = dsn
        self.channels = dict(channels)
        self.connected = False
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
        backoff = Backoff(0.5, 2.0)
        while not self._stop.is_set():
            try:
                with connect(self.dsn, LISTEN) as conn:
                    for channel in self.channels:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    backoff.reset()
                    OUTAGE.back("listener")
                    self.connected = True
                    for wake in self.channels.values():
                        wake(None)  # something may have come while we were not listening
                    while not self._stop.is_set():
                        # One generator per half second, not per notification: at a thousand
                        # notifications a second, setting one up each time showed in profiles.
                        for note in conn.notifies(timeout=0.5):
                            wake = self.channels.get(note.channel)
                            if wake is not None:
                                wake(note.payload)
                            if self._stop.is_set():
                                break
            except psycopg.Error as exc:
                self.connected = False
                if unreachable(exc):
                    OUTAGE.lost("listener", exc)
                else:
                    log.info(
                        "listener disconnected (%s); polling until it reconnects",
                        type(exc).__name__,
                    )
                self._stop.wait(backoff.next())
        self.connected = False


__all__ = ["Listener"]
