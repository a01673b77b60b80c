"""One worker process: claim batches, run handlers on a pool of threads, acknowledge in batches.

The main thread owns every conversation with the database about task state (claim, complete,
retry, release, heartbeat, rescue, purge), each a single statement per batch. Runner threads only
run handlers and report outcomes back through a queue, so the hot path costs one claim and one or
two acknowledgements per batch, never a query per task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue as queue_mod
import random
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from . import _transitions as tr
from ._backoff import retry_delay
from ._cron import make_ticker
from ._errors import DoNotRetry, LostLease
from ._hooks import Hooks
from ._migrate import require_schema
from ._registry import DEFAULT_BACKOFF, DEFAULT_QUEUE, Context, Registry, TaskDef, registry
from ._sql import notify_channel, queries
from ._supervisor import LIVENESS_ENV

log = logging.getLogger("worker")

_WAKE = object()
_MAX_ERROR_CHARS = 4000
# Longest an outcome waits to be acknowledged with others (unless a claim or stop comes first).
_MAX_ACK_DELAY = 0.02


@dataclass
class WorkerConfig:
    """Everything a worker process needs; the CLI fills it from flags and the environment."""

    dsn: str
    schema: str = "worker"
    queues: list[str] | None = None  # None: the queues of the registered tasks, plus "default"
    concurrency: int = 10
    batch_size: int = 100
    lease_seconds: float = 30.0
    poll_interval: float = 1.0
    grace_seconds: float = 30.0
    listen: bool = True
    listen_dsn: str | None = None  # a direct connection for LISTEN when dsn goes through PgBouncer
    keep_done_seconds: float = 3600.0  # 0: delete rows as they complete
    keep_failed_seconds: float = 7 * 86400.0
    cron_keep_seconds: float = 86400.0
    purge_interval: float = 60.0
    cursor_reset_seconds: float = 1.0
    max_abandoned: int | None = None  # stuck handler threads tolerated before the process gives up
    check_schema: bool = True
    # Behind PgBouncer in transaction mode, server-side prepared statements break: turn them off.
    prepare: bool = True
    burst: bool = False  # stop once nothing is due and nothing is in flight

    @property
    def heartbeat_seconds(self) -> float:
        return max(self.lease_seconds / 3, 0.05)

    @property
    def rescue_seconds(self) -> float:
        return max(self.lease_seconds / 2, 0.1)


@dataclass(slots=True)
class _Job:
    token: int
    claimed: tr.Claimed
    definition: TaskDef
    dispatched: float
    deadline: float | None
    lost: bool = False


@dataclass(slots=True)
class _Outcome:
    token: int
    ok: bool
    error: str | None = None
    permanent: bool = False
    duration: float = 0.0
    acked: bool = False  # transactional handlers complete their row themselves


@dataclass
class _Pending:
    """Outcomes waiting to be acknowledged together."""

    done: list[tuple[int, int]] = field(default_factory=list)
    failed: list[tr.Failure] = field(default_factory=list)
    since: float = 0.0  # when the oldest waiting outcome arrived

    def __bool__(self) -> bool:
        return bool(self.done or self.failed)

    def __len__(self) -> int:
        return len(self.done) + len(self.failed)

    def mark(self) -> None:
        if not self:
            self.since = time.monotonic()


def format_error(exc: BaseException, *, frames: int = 5) -> str:
    """``Type: message`` then the last few traceback frames: enough to find the line, bounded."""
    head = f"{type(exc).__name__}: {exc}"
    tail = "".join(traceback.format_tb(exc.__traceback__)[-frames:])
    text = f"{head}\n{tail}".rstrip() if tail else head
    return text[:_MAX_ERROR_CHARS]


class Worker:
    """A worker process's engine. ``run()`` blocks until ``stop()`` and returns an exit code."""

    def __init__(
        self,
        config: WorkerConfig,
        tasks: Registry | None = None,
        *,
        hooks: Hooks | None = None,
    ) -> None:
        self.config = config
        self.registry = tasks or registry
        self.hooks = hooks or Hooks()
        self.id = str(uuid.uuid4())
        self.q = queries(config.schema)
        queues = config.queues or sorted({*self.registry.queues(), DEFAULT_QUEUE})
        self.queues = list(dict.fromkeys(queues))
        # For rows whose producer left max_attempts to the handler (see tr.claim).
        self._max_attempts = {
            name: d.max_attempts for name in self.registry.names() if (d := self.registry.get(name))
        }
        self._stop = threading.Event()
        self._stop_now = threading.Event()
        self._events: queue_mod.SimpleQueue[Any] = queue_mod.SimpleQueue()
        self._work: queue_mod.SimpleQueue[_Job | None] = queue_mod.SimpleQueue()
        self._in_flight: dict[int, _Job] = {}
        self._tokens = 0
        self._threads: list[threading.Thread] = []
        self._abandoned = 0
        self._cursor = tr.ClaimCursor(config.cursor_reset_seconds)
        self._deadlines = 0  # in-flight jobs with a timeout, so the loop skips the scan when 0
        self._queue_turn = 0
        self._last_claim = 0.0  # monotonic time of the last claim statement
        self.exit_code = 0
        self.pool: ConnectionPool | None = None
        self._max_abandoned = config.max_abandoned or max(config.concurrency, 4)
        self._cron = _cron_ticker(config.schema, config.cron_keep_seconds)
        self._liveness = os.environ.get(LIVENESS_ENV)
        self._touched = 0.0
        # Wall-clock marks for the benchmark: first claim, last acknowledgement, tasks done.
        self.first_claim: float | None = None
        self.last_ack: float | None = None
        self.done_count = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def stop(self, *, now: bool = False) -> None:
        """Ask for a graceful stop (finish or hand back in-flight tasks); ``now`` skips the wait."""
        self._stop.set()
        if now:
            self._stop_now.set()
        self._events.put(_WAKE)

    def run(self) -> int:
        cfg = self.config
        self.pool = ConnectionPool(
            cfg.dsn,
            min_size=1,
            max_size=cfg.concurrency + 2,
            kwargs={"autocommit": True, "prepare_threshold": 5 if cfg.prepare else None},
            open=False,
            name=f"worker-{self.id[:8]}",
            # While the database is down the main loop must not wait 30 s (the default) for a
            # connection: it would neither stop promptly nor show the supervisor it is alive.
            timeout=5.0,
        )
        self.pool.open(wait=True, timeout=15)
        try:
            with self.pool.connection() as conn:
                if cfg.check_schema:
                    require_schema(conn, cfg.schema)
                conn.execute(
                    self.q["register"],
                    {
                        "worker_id": self.id,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "queues": self.queues,
                        "concurrency": cfg.concurrency,
                    },
                )
            for _ in range(cfg.concurrency):
                self._start_runner()
            listener = None
            if cfg.listen:
                listener = threading.Thread(target=self._listen, name="worker-listen", daemon=True)
                listener.start()
            log.info(
                "worker %s started: queues=%s concurrency=%d batch=%d",
                self.id[:8],
                ",".join(self.queues),
                cfg.concurrency,
                cfg.batch_size,
            )
            self.hooks.started(self)
            self._loop()
            self._shutdown()
        finally:
            for _ in self._threads:
                self._work.put(None)
            self.pool.close(timeout=2)
            self.hooks.stopped(self)
        return self.exit_code

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        cfg = self.config
        pending = _Pending()
        next_heartbeat = time.monotonic() + cfg.heartbeat_seconds
        next_rescue = time.monotonic() + random.uniform(0, cfg.rescue_seconds)
        next_purge = time.monotonic() + random.uniform(0, cfg.purge_interval)
        next_cron = time.monotonic()
        backoff = 0.0
        more = True  # the last claim came back full: claim again without waiting
        while not self._stop.is_set():
            now = time.monotonic()
            wait = 0.0 if more else self._wait_time(pending, now, next_heartbeat)
            woken = self._collect(pending, block=wait > 0, timeout=wait)
            try:
                now = time.monotonic()
                ready = self._ready_to_claim() and not self._stop.is_set()
                if (
                    pending
                    and not ready
                    and (
                        not self._in_flight
                        or len(pending) >= cfg.batch_size
                        or now - pending.since >= _MAX_ACK_DELAY
                    )
                ):
                    self._flush(pending)
                if now >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = now + cfg.heartbeat_seconds
                if now >= next_rescue:
                    self._rescue()
                    next_rescue = now + cfg.rescue_seconds * random.uniform(0.8, 1.2)
                if self._cron is not None and now >= next_cron:
                    with self.pool.connection() as conn:  # type: ignore[union-attr]
                        n = self._cron.tick(conn)
                    if n:
                        self.hooks.cron_enqueued(self, n)
                    next_cron = now + self._cron.interval
                if now >= next_purge:
                    self._purge()
                    next_purge = now + cfg.purge_interval * random.uniform(0.8, 1.2)
                if self._deadlines:
                    self._check_deadlines(pending)
                more = False
                if ready:
                    claimed, more = self._claim(pending)
                    if woken and claimed == 0:
                        # A NOTIFY may announce rows behind our cursor (a higher priority, say).
                        for q in self.queues:
                            self._cursor.reset(q, now)
                    if cfg.burst and claimed == 0 and not self._in_flight and not pending:
                        break
                if self._liveness and now - self._touched >= 1.0:
                    # Tells the supervisor this loop is alive (see _supervisor.Supervisor._stuck).
                    os.utime(self._liveness)
                    self._touched = now
                backoff = 0.0
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                backoff = min(max(backoff * 2, 0.2), 10.0)
                more = False
                self.hooks.db_error(self, exc)
                log.warning(
                    "database unavailable (%s); retrying in %.1fs",
                    str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__,
                    backoff,
                )
                # Retrying is not stuck: keep telling the supervisor so while waiting, or an
                # outage longer than its stuck limit gets every worker process killed.
                end = time.monotonic() + backoff
                while not self._stop.is_set() and (left := end - time.monotonic()) > 0:
                    if self._liveness:
                        os.utime(self._liveness)
                        self._touched = time.monotonic()
                    self._stop.wait(min(left, 1.0))

    def _ready_to_claim(self) -> bool:
        """Claim when at least half a batch of slots is free, so claims stay large when tasks
        are short, or when nothing at all is running, or when free slots have waited a poll
        interval: long tasks free slots one at a time and may not free more for hours, which
        left slots idle while tasks were queued."""
        free = self.config.concurrency - len(self._in_flight)
        want = min(self.config.batch_size, self.config.concurrency)
        if free <= 0:
            return False
        if not self._in_flight or free >= max(1, want // 2):
            return True
        return time.monotonic() - self._last_claim >= self.config.poll_interval

    def _wait_time(self, pending: _Pending, now: float, next_heartbeat: float) -> float:
        """Sleep until an outcome, a NOTIFY, the ack delay, a handler deadline, the heartbeat,
        or the poll interval, whichever comes first."""
        wait = min(self.config.poll_interval, max(next_heartbeat - now, 0.0))
        if pending:
            wait = min(wait, max(pending.since + _MAX_ACK_DELAY - now, 0.0))
        if self._deadlines:
            soonest = min(j.deadline for j in self._in_flight.values() if j.deadline)
            wait = min(wait, max(soonest - now, 0.0) + 0.01)
        return max(wait, 0.001)

    def _collect(self, pending: _Pending, *, block: bool, timeout: float) -> bool:
        """Move finished outcomes into ``pending``; block for the first one when idle.

        When the worker is busy it does not sleep here: it goes straight back to claiming, and the
        outcomes that arrived meanwhile are acknowledged together in the next flush.
        """
        woken = False
        try:
            item = self._events.get(timeout=timeout) if block else self._events.get_nowait()
        except queue_mod.Empty:
            return False
        while True:
            if item is _WAKE:
                woken = True
            else:
                self._record(item, pending)
            try:
                item = self._events.get_nowait()
            except queue_mod.Empty:
                return woken
        return woken

    def _record(self, outcome: _Outcome, pending: _Pending) -> None:
        job = self._in_flight.pop(outcome.token, None)
        if job is None:
            return  # abandoned after its timeout: its row was already retried
        c = job.claimed
        if job.lost:
            log.warning(
                "task %d (%s) finished after its lease was lost; result discarded", c.id, c.task
            )
            return
        if job.deadline is not None:
            self._deadlines -= 1
        self.hooks.finished(self, job.definition, c, outcome.ok, outcome.duration)
        if outcome.acked:
            self.hooks.acked(self, "done", [c.id])
            return
        pending.mark()
        if outcome.ok:
            pending.done.append((c.id, c.attempt))
        else:
            pending.failed.append(self._failure(job, outcome.error or "", outcome.permanent))

    def _failure(self, job: _Job, error: str, permanent: bool) -> tr.Failure:
        c = job.claimed
        base = job.definition.retry_backoff if job.definition else DEFAULT_BACKOFF
        return tr.Failure(c.id, c.attempt, retry_delay(c.attempt, base), error, permanent)

    def _flush(self, pending: _Pending) -> None:
        """Acknowledge on its own, when no claim is due to carry the acknowledgements."""
        if not pending:
            return
        assert self.pool is not None
        with self.pool.connection() as conn, self._counted(conn):
            acked = self._ack(conn, pending)
            self._report_acked(pending, *acked)
        self._acked(pending, *acked)

    @contextlib.contextmanager
    def _counted(self, conn: psycopg.Connection) -> Iterator[None]:
        """A transaction whose events the hooks hear inside it, so that an observer can tie what
        it counts to the commit (see _hooks.Hooks.begin)."""
        hooks = self.hooks
        hooks.begin()
        try:
            with conn.transaction():
                yield
                hooks.prepare(self, conn)
        except BaseException:
            hooks.rollback()
            raise
        hooks.commit()

    def _ack(self, conn: psycopg.Connection, pending: _Pending) -> tuple[set[int], dict[int, str]]:
        """Run the acknowledgement statements; the caller commits, then calls ``_acked``."""
        kept: set[int] = set()
        states: dict[int, str] = {}
        if pending.done:
            delete = self.config.keep_done_seconds <= 0
            kept = tr.complete(conn, self.q, worker_id=self.id, done=pending.done, delete=delete)
        if pending.failed:
            states = tr.fail(conn, self.q, worker_id=self.id, failures=pending.failed)
        return kept, states

    def _report_acked(self, pending: _Pending, kept: set[int], states: dict[int, str]) -> None:
        """Inside the acknowledging transaction: tell the hooks what it changed."""
        if pending.done:
            self.hooks.acked(self, "done", [i for i, _ in pending.done if i in kept])
        if pending.failed:
            self.hooks.acked(self, "failed", states)

    def _acked(self, pending: _Pending, kept: set[int], states: dict[int, str]) -> None:
        """After the commit: log, and empty ``pending``."""
        if pending.done:
            sent = pending.done
            self._report_lost([i for i, _ in sent if i not in kept], "complete")
            self.done_count += len(kept)
            self.last_ack = time.time()
            pending.done = []
        if pending.failed:
            sent_f = pending.failed
            self._report_lost([f.id for f in sent_f if f.id not in states], "retry")
            for f in sent_f:
                if f.id in states:
                    level = logging.WARNING if states[f.id] == "failed" else logging.INFO
                    log.log(
                        level,
                        "task %d attempt %d %s: %s",
                        f.id,
                        f.attempt,
                        "failed for good" if states[f.id] == "failed" else "will retry",
                        f.error.splitlines()[0] if f.error else "",
                    )
            pending.failed = []

    def _report_lost(self, ids: Iterable[int], action: str) -> None:
        for task_id in ids:
            log.warning(
                "could not %s task %d: this worker no longer owns it (lease expired, rescued)",
                action,
                task_id,
            )

    def _claim(self, pending: _Pending) -> tuple[int, bool]:
        """Acknowledge what is pending and fill free slots, in one transaction.

        One commit per batch instead of two: with durable commits the WAL flush, not the SQL,
        is what a batch costs most. If anything fails, both roll back together: the finished
        tasks stay pending here and the rows we tried to claim stay queued. One claim
        statement per queue, round-robin. Returns how many rows were claimed and whether some
        queue came back full (more may be waiting).
        """
        cfg = self.config
        free = cfg.concurrency - len(self._in_flight)
        assert self.pool is not None
        self._last_claim = time.monotonic()
        claimed: list[tuple[str, float, int, list[tr.Claimed]]] = []
        with self.pool.connection() as conn, self._counted(conn):
            acked = self._ack(conn, pending) if pending else None
            for i in range(len(self.queues)):
                if free <= 0:
                    break
                name = self.queues[(self._queue_turn + i) % len(self.queues)]
                now = time.monotonic()
                limit = min(cfg.batch_size, free)
                rows = tr.claim(
                    conn,
                    self.q,
                    queue=name,
                    limit=limit,
                    worker_id=self.id,
                    lease_seconds=cfg.lease_seconds,
                    cursor=self._cursor.position(name, now),
                    max_attempts=self._max_attempts,
                )
                claimed.append((name, now, limit, rows))
                free -= len(rows)
            if acked is not None:
                self._report_acked(pending, *acked)
            for _name, _now, _limit, rows in claimed:
                if rows:
                    self.hooks.claimed(self, rows)
        if acked is not None:
            self._acked(pending, *acked)
        self._queue_turn += 1
        total, full = 0, False
        for name, now, limit, rows in claimed:
            if rows:
                if self.first_claim is None:
                    self.first_claim = time.time()
                self._cursor.advance(name, rows[-1])
                self._dispatch(rows)
                total += len(rows)
            if len(rows) < limit:
                self._cursor.reset(name, now)
            else:
                full = True
        return total, full

    def _dispatch(self, rows: list[tr.Claimed]) -> None:
        now = time.monotonic()
        for c in rows:
            self._tokens += 1
            definition = self.registry.get(c.task)
            if definition is None:
                known = ", ".join(self.registry.names()) or "none"
                error = (
                    f"UnknownTask: no handler named {c.task!r} is registered in this worker "
                    f"(known: {known}); check the task name or deploy a worker that has it"
                )
                job = _Job(self._tokens, c, _UNKNOWN, now, None)
                self._in_flight[job.token] = job
                self._events.put(_Outcome(job.token, ok=False, error=error))
                continue
            deadline = now + definition.timeout + 0.25 if definition.timeout else None
            if deadline is not None:
                self._deadlines += 1
            job = _Job(self._tokens, c, definition, now, deadline)
            self._in_flight[job.token] = job
            self._work.put(job)

    # -- maintenance ---------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        assert self.pool is not None
        live = [j for j in self._in_flight.values() if not j.lost]
        with self.pool.connection() as conn:
            owned = tr.heartbeat(
                conn,
                self.q,
                worker_id=self.id,
                ids=[j.claimed.id for j in live],
                lease_seconds=self.config.lease_seconds,
            )
        for job in live:
            if job.claimed.id not in owned:
                job.lost = True
                log.warning(
                    "lost task %d (%s): its lease expired and it was rescued; "
                    "this worker will not complete it",
                    job.claimed.id,
                    job.claimed.task,
                )
                self.hooks.lost(self, job.claimed)

    def _rescue(self) -> None:
        assert self.pool is not None
        with self.pool.connection() as conn:
            while True:
                with self._counted(conn):
                    rows = tr.rescue(conn, self.q, limit=1000)
                    if rows:
                        self.hooks.rescued(self, rows)
                if rows:
                    log.warning("rescued %d task(s) whose lease expired", len(rows))
                if len(rows) < 1000:
                    break

    def _purge(self) -> None:
        cfg = self.config
        if cfg.keep_done_seconds < 0:
            return
        assert self.pool is not None
        with self.pool.connection() as conn:
            for _ in range(20):  # bounded: a backlog is worked off over several rounds
                n = tr.purge(
                    conn,
                    self.q,
                    done_seconds=cfg.keep_done_seconds,
                    failed_seconds=cfg.keep_failed_seconds,
                    cron_keep_seconds=cfg.cron_keep_seconds,
                )
                if n < 5000:
                    break
            conn.execute(self.q["forget_stale"], {"older_than_seconds": 86400.0})

    def _check_deadlines(self, pending: _Pending) -> None:
        """Abandon handlers past their timeout: retry their rows and replace their threads."""
        now = time.monotonic()
        expired = [j for j in self._in_flight.values() if j.deadline and now > j.deadline]
        for job in expired:
            del self._in_flight[job.token]
            self._deadlines -= 1
            timeout = job.definition.timeout
            pending.mark()
            pending.failed.append(
                self._failure(
                    job,
                    f"TimeoutError: handler ran longer than its timeout of {timeout:g}s "
                    "and was abandoned",
                    False,
                )
            )
            self.hooks.finished(self, job.definition, job.claimed, False, now - job.dispatched)
            if job.definition.is_async:
                continue  # its own loop cancels it; the thread comes back by itself
            self._abandoned += 1
            log.error(
                "task %d (%s) exceeded its %gs timeout; abandoned its thread (%d abandoned)",
                job.claimed.id,
                job.claimed.task,
                timeout,
                self._abandoned,
            )
            if self._abandoned > self._max_abandoned:
                log.error(
                    "%d handler threads are stuck; stopping this process so it can be replaced",
                    self._abandoned,
                )
                self.exit_code = 3
                self.stop(now=True)
            else:
                self._start_runner()

    # -- stopping ------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Wait up to the grace period for in-flight tasks, acknowledge them, hand back the rest."""
        cfg = self.config
        pending = _Pending()
        deadline = time.monotonic() + (0 if self._stop_now.is_set() else cfg.grace_seconds)
        if self._in_flight:
            log.info(
                "stopping: waiting up to %.0fs for %d task(s)",
                cfg.grace_seconds,
                len(self._in_flight),
            )
        while self._in_flight and time.monotonic() < deadline and not self._stop_now.is_set():
            self._collect(pending, block=True, timeout=min(0.2, deadline - time.monotonic()))
            self._check_deadlines(pending)
        self._collect(pending, block=False, timeout=0)
        unfinished = [(j.claimed.id, j.claimed.attempt) for j in self._in_flight.values()]
        for attempt in range(5):
            try:
                self._flush(pending)
                assert self.pool is not None
                with self.pool.connection() as conn:
                    if unfinished:
                        returned = tr.release(conn, self.q, worker_id=self.id, tasks=unfinished)
                        log.warning("handed back %d unfinished task(s)", len(returned))
                        unfinished = []
                    conn.execute(self.q["unregister"], {"worker_id": self.id})
                break
            except psycopg.OperationalError as exc:
                log.warning("could not settle tasks on stop (%s); retrying", exc)
                time.sleep(min(0.5 * 2**attempt, 4))
        log.info("worker %s stopped", self.id[:8])

    # -- threads -------------------------------------------------------------------------------

    def _start_runner(self) -> None:
        t = threading.Thread(
            target=self._runner, name=f"worker-run-{len(self._threads)}", daemon=True
        )
        self._threads.append(t)
        t.start()

    def _runner(self) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        events = self._events
        get = self._work.get
        while True:
            job = get()
            if job is None:
                if loop is not None:
                    loop.close()
                return
            d = job.definition
            c = job.claimed
            start = time.perf_counter()
            outcome = _Outcome(job.token, ok=True)
            try:
                if d.transactional:
                    self._run_transactional(job)
                    outcome.acked = True
                elif d.is_async:
                    if loop is None:
                        loop = asyncio.new_event_loop()
                    coro = (
                        d.fn(c.payload, self._context(job)) if d.wants_context else d.fn(c.payload)
                    )
                    if d.timeout:
                        coro = asyncio.wait_for(coro, d.timeout)
                    loop.run_until_complete(coro)
                elif d.wants_context:
                    d.fn(c.payload, self._context(job))
                else:
                    d.fn(c.payload)
            except DoNotRetry as exc:
                outcome.ok, outcome.permanent, outcome.error = False, True, format_error(exc)
            except TimeoutError as exc:
                outcome.ok = False
                outcome.error = (
                    f"TimeoutError: handler ran longer than its timeout of {d.timeout:g}s"
                    if d.is_async and d.timeout
                    else format_error(exc)
                )
            except BaseException as exc:  # a handler's SystemExit must not kill the worker
                outcome.ok, outcome.error = False, format_error(exc)
            outcome.duration = time.perf_counter() - start
            events.put(outcome)

    def _context(self, job: _Job, conn: psycopg.Connection | None = None) -> Context:
        c = job.claimed
        return Context(c.id, c.task, c.queue, c.attempt, c.max_attempts, self.id, conn)

    def _run_transactional(self, job: _Job) -> None:
        """Run the handler inside the transaction that marks its task done (fenced)."""
        assert self.pool is not None
        c = job.claimed
        with self.pool.connection() as conn, conn.transaction():
            job.definition.fn(c.payload, self._context(job, conn))
            kept = tr.complete(conn, self.q, worker_id=self.id, done=[(c.id, c.attempt)])
            if c.id not in kept:
                raise LostLease(
                    f"task {c.id} was rescued while its handler ran; its writes are rolled back"
                )

    def _listen(self) -> None:
        """Wake the main loop on NOTIFY. Optional: without it the worker polls."""
        dsn = self.config.listen_dsn or self.config.dsn
        channel = sql.Identifier(notify_channel(self.config.schema))
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(channel))
                    backoff = 0.5
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            self._events.put(_WAKE)
            except psycopg.Error as exc:
                log.info(
                    "listener disconnected (%s); polling until it reconnects", type(exc).__name__
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)


def _cron_ticker(schema: str, keep_seconds: float) -> Any:
    """The cron scheduler for this process's schedules, or None when it declares none.

    Each worker process enqueues due cron slots itself; the unique (cron_key, cron_at) index
    makes exactly one insert per slot win, so no leader is needed (see _cron).
    """
    # Never offer a slot older than cron rows are kept: a purged slot could run again.
    return make_ticker(schema, horizon_seconds=keep_seconds)


def _unknown_handler(payload: Any) -> None:  # pragma: no cover - never called
    raise RuntimeError("unknown task")


_UNKNOWN = TaskDef(name="<unknown>", fn=_unknown_handler)


def run_worker(config: WorkerConfig, tasks: Registry | None = None, **kwargs: Any) -> int:
    return Worker(config, tasks, **kwargs).run()


__all__ = ["Worker", "WorkerConfig", "format_error", "run_worker"]
