"""Sign-in throttling, per client address, in bounded memory and with a bounded log.

An address that fails to sign in ``MAX_FAILURES`` times within ``WINDOW`` seconds is locked:
every sign-in from it is refused (429, with Retry-After) without the token being looked at, the
right token included, until the lock ends. The first lock lasts ``FIRST_LOCK`` seconds; while the
address keeps failing, each lock doubles (up to ``MAX_LOCK``), and a single failure after a lock
starts the next one. A successful sign-in, or ``FORGET_AFTER`` seconds without an attempt, forgets
the address.

At most ``MAX_ADDRESSES`` addresses are remembered (the least recently seen goes first), so an
attacker rotating addresses cannot grow the table. The log says, per address and burst: the first
failure, the lock (how many failures in how long, and for how long it is locked), and how many
sign-ins were refused while it was locked; never one line per attempt. At most ``LOG_LINES`` such
lines a minute in all: beyond, they are counted and the next line says how many were left out.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("worker.console")

WINDOW = 60.0  # seconds in which MAX_FAILURES failures lock an address
MAX_FAILURES = 5
FIRST_LOCK = 60.0  # seconds; doubled at each lock while failures go on
MAX_LOCK = 900.0
FORGET_AFTER = 3600.0  # seconds without an attempt after which an address starts afresh
MAX_ADDRESSES = 10_000
LOG_LINES = 20  # lines about failed sign-ins per minute, all addresses together


@dataclass
class _Address:
    failures: list[float]  # times of the failures within the window (at most MAX_FAILURES)
    last: float = 0.0  # the latest attempt
    burst: int = 0  # failed or refused attempts since the burst's first failure
    burst_start: float = 0.0
    locks: int = 0  # locks so far (the next one lasts FIRST_LOCK * 2 ** locks)
    locked_until: float = 0.0
    lock_seconds: float = 0.0
    refused: int = 0  # attempts refused during the current lock, not yet logged


class SignInThrottle:
    """Decides whether an address may try a sign-in, and keeps what it needs to decide."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._addresses: OrderedDict[str, _Address] = OrderedDict()
        self._ends: list[tuple[float, str]] = []  # (lock end, address): locks to report
        self._lock = threading.Lock()
        self._lines: list[float] = []  # times of the last LOG_LINES lines
        self._left_out = 0

    def __len__(self) -> int:
        return len(self._addresses)

    def locked(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: it may now). A locked address's attempt
        is counted as refused."""
        with self._lock:
            now = self.clock()
            self._report_ended(now)
            entry = self._entry(address, now, create=False)
            if entry is None or entry.locked_until <= now:
                return 0.0
            entry.refused += 1
            entry.burst += 1
            entry.last = now
            return entry.locked_until - now

    def failed(self, address: str) -> float:
        """Record a wrong token from ``address``; the seconds it is now locked for (0: none)."""
        with self._lock:
            now = self.clock()
            entry = self._entry(address, now, create=True)
            assert entry is not None
            if entry.burst == 0 and entry.locks == 0:
                entry.burst_start = now
                self._log("console: failed sign-in from %s (wrong token)", address)
            entry.burst += 1
            entry.last = now
            entry.failures = [t for t in entry.failures if now - t < WINDOW][-MAX_FAILURES + 1 :]
            entry.failures.append(now)
            if entry.locks == 0 and len(entry.failures) < MAX_FAILURES:
                return 0.0
            seconds = min(FIRST_LOCK * 2**entry.locks, MAX_LOCK)
            self._log(
                "console: %s failed sign-ins from %s in the last %s s; locked for %s s",
                f"{entry.burst:,}",
                address,
                f"{max(now - entry.burst_start, 1):,.0f}",
                f"{seconds:,.0f}",
            )
            entry.locks += 1
            entry.locked_until = now + seconds
            entry.lock_seconds = seconds
            entry.failures = []
            entry.burst, entry.burst_start = 0, now
            if len(self._ends) < MAX_ADDRESSES:
                heapq.heappush(self._ends, (entry.locked_until, address))
            return seconds

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._addresses.pop(address, None)

    def _entry(self, address: str, now: float, *, create: bool) -> _Address | None:
        entry = self._addresses.get(address)
        if entry is not None and entry.locked_until <= now and now - entry.last > FORGET_AFTER:
            del self._addresses[address]
            entry = None
        if entry is None:
            if not create:
                return None
            entry = _Address([], now)
            self._addresses[address] = entry
            while len(self._addresses) > MAX_ADDRESSES:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(address)
        return entry

    def _report_ended(self, now: float) -> None:
        """One line for each lock that ended during which sign-ins were refused."""
        while self._ends and self._ends[0][0] <= now:
            end, address = heapq.heappop(self._ends)
            entry = self._addresses.get(address)
            if entry is None or entry.locked_until != end or not entry.refused:
                continue
            self._log(
                "console: %s sign-ins from %s refused while it was locked (%s s)",
                f"{entry.refused:,}",
                address,
                f"{entry.lock_seconds:,.0f}",
            )
            entry.refused = 0

    def _log(self, message: str, *args: object) -> None:
        now = self.clock()
        self._lines = [t for t in self._lines if now - t < 60]
        if len(self._lines) >= LOG_LINES:
            self._left_out += 1
            return
        self._lines.append(now)
        if self._left_out:
            message += " (%s more such lines left out in the last minute)"
            args = (*args, f"{self._left_out:,}")
            self._left_out = 0
        log.warning(message, *args)


def retry_after(seconds: float) -> str:
    """A Retry-After header's value: whole seconds, rounded up."""
    return str(max(1, math.ceil(seconds)))


__all__ = ["SignInThrottle", "retry_after"]
