"""The process pool: start P worker processes, replace the ones that die or hang, stop them all.

A worker process can die (OOM kill, a segfault in a C extension, SIGKILL) or hang (a handler
stuck in C code holding the GIL). Neither loses a task, because leases expire and any worker
rescues the rows; the supervisor's job is to keep capacity up and to stop cleanly.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from .. import store
from ..db.connect import SUPERVISOR, connect
from .job import display

log = logging.getLogger("worker.supervisor")

LIVENESS_ENV = "WORKER_LIVENESS_FILE"
WORKER_ID_ENV = "WORKER_ID"  # the id a supervisor gives each child (its rows' worker_id)
PARENT_PID_ENV = "WORKER_PARENT_PID"  # a process started with it dies with that parent
PARENT_SIGNAL_ENV = "WORKER_PARENT_SIGNAL"  # how: SIGKILL (default) or SIGTERM
# The console's token, and the number of the inherited pipe that hands it to a process started
# over without it (see secret_pipe). Neither is ever passed to a child's environment: any process
# of the same user can read /proc/PID/environ, and the kernel shows there the environment a
# process started with, whatever it later removes from os.environ.
CONSOLE_TOKEN_ENV = "WORKER_CONSOLE_TOKEN"
CONSOLE_TOKEN_FD_ENV = "WORKER_CONSOLE_TOKEN_FD"
PRIVATE_ENV = (CONSOLE_TOKEN_ENV, CONSOLE_TOKEN_FD_ENV)
MAX_SECRET_BYTES = 64 * 1024
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Called first thing in a process started by a supervisor (or by ``worker demo``): ask the
    kernel to signal us when our parent dies, however it dies, then check it is not gone already.

    A child gets SIGKILL: a supervisor that died uncleanly (SIGKILL, OOM) cannot stop its children,
    and a child frozen in C code holding the GIL would ignore anything gentler; its rows come back
    when their leases lapse. Without Linux's prctl, the worker's parent watch thread still stops
    a child whose parent is gone (within a second, if its interpreter is responsive)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    sig = getattr(signal, os.environ.get(PARENT_SIGNAL_ENV, "SIGKILL"), signal.SIGKILL)
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if str(os.getppid()) != parent:
        os._exit(1)  # the parent died before we could ask: do not run unsupervised


def child_environ(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a process this one starts: its own without PRIVATE_ENV, plus
    ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}, **extra}


def secret_pipe(value: str) -> int:
    """An inheritable file descriptor from which ``value``, and nothing more, can be read to its
    end: a process started with its number reads the value once and closes it, and the value is
    never in any process's environment or command line. An anonymous memory file on Linux (any
    size, up to MAX_SECRET_BYTES); elsewhere a pipe, whose write end is closed once written,
    for at most 4 KiB (what a pipe's buffer always takes, so the write never waits)."""
    data = value.encode()
    if len(data) > (MAX_SECRET_BYTES if hasattr(os, "memfd_create") else 4096):
        raise ValueError("too long to hand over to another process")
    memory = hasattr(os, "memfd_create")
    fd, write_end = (os.memfd_create("worker-secret", 0),) * 2 if memory else os.pipe()
    try:
        while data:
            data = data[os.write(write_end, data) :]
    finally:
        if memory:
            os.lseek(fd, 0, os.SEEK_SET)
        else:
            os.close(write_end)
    os.set_inheritable(fd, True)
    return fd


def read_secret_pipe(fd_text: str) -> str:
    """The value ``secret_pipe`` put in the pipe whose number is ``fd_text``, read to its end
    (at most MAX_SECRET_BYTES) and the pipe closed; OSError or ValueError when there is none."""
    fd = int(fd_text)
    if fd < 3:
        raise ValueError("not a pipe handed over at start")
    data = b""
    try:
        while len(data) <= MAX_SECRET_BYTES and (chunk := os.read(fd, 8192)):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise ValueError("more than a secret handed over at start")
    return data.decode()


def describe_exit(code: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL``, for messages about a dead process."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _Child:
    slot: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float = 0.0
    liveness: Path | None = None
    spawn_mark: float = 0.0  # the liveness file's mtime when this process was started
    worker_id: str = ""


class Supervisor:
    """Runs ``argv`` (a ``worker run ... --child`` command line) in ``processes`` copies."""

    def __init__(
        self,
        argv: list[str],
        processes: int,
        *,
        grace_seconds: float,
        stuck_seconds: float,
        start_seconds: float = 300.0,
        max_deaths: int = 10,
        death_window: float = 60.0,
        burst: bool = False,
        dsn: str | None = None,
        schema: str = "worker",
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = env or {}
        self.burst = burst
        self.dsn = dsn
        self.schema = schema
        self.argv = argv
        self.children = [_Child(i) for i in range(processes)]
        self.grace_seconds = grace_seconds
        self.stuck_seconds = stuck_seconds
        self.start_seconds = start_seconds
        self.max_deaths = max_deaths
        self.death_window = death_window
        self._stopping = False
        self._signals = 0
        self._dir = Path(tempfile.mkdtemp(prefix="worker-liveness-"))
        self.on_child_exit: Callable[[int], None] | None = None
        # Rows of a dead child handed back at once: (id, queue, task, new state) each.
        self.on_handed_back: Callable[[list[tuple[int, str, str, str]]], None] | None = None

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        if not self._stopping:
            log.info(
                "received %s: stopping workers (grace %.0fs)",
                signal.Signals(signum).name,
                self.grace_seconds,
            )
        elif self._signals > 1:
            # A second signal means "stop now". The children run in their own sessions, so a
            # terminal's Ctrl-C never reaches them: pass it on (a worker treats a second signal
            # as "hand back in-flight tasks at once").
            log.info("received %s again: stopping workers at once", signal.Signals(signum).name)
            for child in self.children:
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGUSR1)  # "stop at once" (see cli.run)
        self._stopping = True

    def _spawn(self, child: _Child) -> None:
        child.liveness = self._dir / f"child-{child.slot}"
        child.liveness.touch()
        child.spawn_mark = child.liveness.stat().st_mtime
        child.worker_id = str(uuid.uuid4())
        env = child_environ(
            {
                **self.env,
                LIVENESS_ENV: str(child.liveness),
                "WORKER_CHILD_SLOT": str(child.slot),
                WORKER_ID_ENV: child.worker_id,
                PARENT_PID_ENV: str(os.getpid()),
                PARENT_SIGNAL_ENV: "SIGKILL",
            }
        )
        # A new process group keeps a terminal's Ctrl-C from reaching the children directly:
        # the supervisor decides when and how they stop.
        child.proc = subprocess.Popen(self.argv, env=env, start_new_session=True)
        child.started = time.monotonic()
        log.info("started worker process %d (pid %d)", child.slot, child.proc.pid)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            self._spawn(child)
        failed = False
        try:
            while not self._stopping:
                time.sleep(0.2)
                if self.burst and all(
                    c.proc is not None and c.proc.poll() == 0 for c in self.children
                ):
                    break
                if not self._watch():
                    failed = True
                    self._stopping = True
        finally:
            code = self._stop_all()
        return 1 if failed else code

    def _watch(self) -> bool:
        """Restart dead children (with backoff), kill stuck ones; False when it cannot keep up."""
        now = time.monotonic()
        for child in self.children:
            proc = child.proc
            if proc is None:
                if now >= child.restart_at:
                    self._spawn(child)
                continue
            code = proc.poll()
            stuck = False
            if code == 0 and self.burst:
                continue  # a burst child that found nothing more to do is finished
            if code is None:
                if self._stuck(child, now):
                    if self._got_going(child):
                        log.error(
                            "worker process %d (pid %d) is stuck; killing it", child.slot, proc.pid
                        )
                    else:
                        log.error(
                            "worker process %d (pid %d) did not start within %.0fs (see "
                            "--start-timeout); killing it",
                            child.slot,
                            proc.pid,
                            self.start_seconds,
                        )
                    proc.kill()
                    proc.wait()
                    code = -signal.SIGKILL
                    stuck = True
                else:
                    continue
            child.proc = None
            if code != 0:
                self._hand_back(child, proc.pid, code, stuck=stuck)
            if self.on_child_exit is not None:
                self.on_child_exit(proc.pid)  # metrics: its live gauges go, its counts stay
            if self._got_going(child):
                # It reached its main loop before dying (an OOM kill, a crashed handler, a stuck
                # loop killed above): not a crash loop, so restart at once and count afresh.
                # Without this, every kill of a healthy child lengthened the restart delay.
                child.deaths.clear()
            child.deaths.append(now)
            while child.deaths and child.deaths[0] < now - self.death_window:
                child.deaths.popleft()
            if len(child.deaths) > self.max_deaths:
                log.error(
                    "worker process %d died %d times in %.0fs (last exit %s); giving up",
                    child.slot,
                    len(child.deaths),
                    self.death_window,
                    code,
                )
                return False
            # Capped so that max_deaths fit in the death window: with a 30 s cap a child dying
            # at start-up could never die often enough to trip the limit, and was restarted
            # forever instead of the supervisor giving up.
            cap = self.death_window / (2 * self.max_deaths)
            delay = min(cap, 0.25 * 2 ** (len(child.deaths) - 1))
            child.restart_at = now + delay
            log.warning(
                "worker process %d exited with %s; restarting in %.1fs", child.slot, code, delay
            )
        return True

    def _hand_back(self, child: _Child, pid: int, code: int, *, stuck: bool = False) -> None:
        """A child died: put its running rows back now, with an error that says so, instead of
        leaving them to lapse (see store.worker_died). In the background: it may wait for the
        database, and the rows' leases are the fallback anyway."""
        if not self.dsn or not child.worker_id:
            return
        how = (
            f"stopped responding for {self.stuck_seconds:g}s and was killed by its supervisor"
            if stuck
            else f"died ({describe_exit(code)})"
        )
        error = f"WorkerDied: worker process {pid} (worker {child.worker_id}) {how}"
        args = (self.dsn, self.schema, child.worker_id, error)
        threading.Thread(
            target=self._worker_died, args=args, name="worker-died", daemon=True
        ).start()

    def _worker_died(self, dsn: str, schema: str, worker_id: str, error: str) -> None:
        try:
            with connect(dsn, SUPERVISOR) as conn:
                rows = store.worker_died(conn, schema, worker_id=worker_id, error=error)
        except psycopg.Error as exc:
            log.warning(
                "could not hand back a dead worker's tasks (%s); their leases will lapse", exc
            )
            return
        if rows and self.on_handed_back is not None:
            self.on_handed_back(rows)  # metrics: they count as rescued (or failed)
        if rows:
            tasks = ", ".join(f"{r[0]} ({display(r[2], 100)})" for r in rows[:20])
            more = f" and {len(rows) - 20} more" if len(rows) > 20 else ""
            log.warning("%s; handed back its task(s) %s%s", error, tasks, more)

    def _got_going(self, child: _Child) -> bool:
        """Whether the child touched its liveness file since it was started (its loop ran)."""
        try:
            return child.liveness is not None and child.liveness.stat().st_mtime > child.spawn_mark
        except OSError:
            return False

    def _stuck(self, child: _Child, now: float) -> bool:
        if child.liveness is None:
            return False
        if not self._got_going(child):
            # Still importing the application (a large framework can take a while): the loop has
            # not touched the file yet, so judge it by the start-up allowance instead.
            return now - child.started > self.start_seconds
        if now - child.started < self.stuck_seconds:
            return False
        try:
            age = time.time() - child.liveness.stat().st_mtime
        except OSError:
            return False
        return age > self.stuck_seconds

    def _stop_all(self) -> int:
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds + 5
        code = 0
        for proc in live:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                rc = proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                log.error("worker process pid %d did not stop in time; killing it", proc.pid)
                proc.kill()
                rc = proc.wait()
            # -SIGTERM: the child was still starting and had no handler yet; it held no task.
            if rc not in (0, -signal.SIGTERM):
                code = 1
        for path in self._dir.glob("*"):
            path.unlink(missing_ok=True)
        self._dir.rmdir()
        return code


# Options whose values may hold a password: never on a child's command line.
DSN_OPTIONS = ("--dsn", "--listen-dsn")


def without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without the given options and their values (``--opt V`` or ``--opt=V``)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in options)):
            kept.append(arg)
    return kept


def child_command(argv: list[str]) -> list[str]:
    """The command line of one worker process: the same options, one process, marked as a child,
    without --dsn or --listen-dsn (the supervisor passes DSNs in the environment: argv is
    public)."""
    kept = without_options(argv, DSN_OPTIONS)
    return [sys.executable, "-m", "worker", *kept, "--processes", "1", "--child"]
