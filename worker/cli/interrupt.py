"""SIGINT and SIGTERM while a bulk action runs: stop between two batches, then say so."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

import psycopg

_STOPPING = "worker: {}: stopping after the batch in flight (again: cancel that batch)\n"


class Interrupt:
    """SIGINT and SIGTERM while a bulk action runs (``with Interrupt() as stop:``, then
    ``apply(..., stop=stop)``): the first asks the action to stop after the batch in flight,
    which commits, so that nothing is left half-done and the record holds the counts of every
    batch that committed; the second cancels the batch in flight (rolled back whole); a third
    does what the signal does by default. ``conn``: the connection whose statement the second
    cancels."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, tell: bool = False) -> None:
        self.tell = tell  # say on stderr that the action stops (a person at a terminal)
        self.name: str | None = None  # the first signal's name, as "SIGTERM"
        self.code = 0  # the exit code that reports it: 128 + its number
        self.conn: psycopg.Connection | None = None
        self._previous: dict[int, Any] = {}

    def __call__(self) -> str | None:
        return self.name

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.name is None:
            self.name = signal.Signals(signum).name
            self.code = 128 + signum
            if self.tell:  # os.write: print() could be in the middle of a write of its own
                with contextlib.suppress(OSError):
                    os.write(2, _STOPPING.format(self.name).encode())
            return
        self._restore()  # a third signal does what it does by default
        conn = self.conn
        if conn is not None:
            with contextlib.suppress(Exception):
                getattr(conn, "cancel_safe", conn.cancel)()
