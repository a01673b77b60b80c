"""One worker process: claim batches, hand them to runner threads, acknowledge in batches.

Four kinds of thread, each with one job and its own connection, so none can delay another:

* the main thread (this module) claims and acknowledges: one transaction per batch that
  acknowledges the finished jobs and claims the next rows, and nothing else;
* runner threads (``_executor``) run handlers and report outcomes as plain values;
* the lease keeper (``_lease``) renews the leases of every job the process holds;
* maintenance (``_maintenance``) rescues expired rows, purges old ones and enqueues cron slots.

Each job is a small state machine (``_job``). A graceful stop acknowledges finished jobs as they
arrive, keeps renewing the running ones through the grace period, then hands back the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_mod
import socket
import threading
import time
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
from ._errors import LostLease
from ._executor import Executor
from ._hooks import Hooks
from ._job import LEASED, Job, Outcome, State, format_error
from ._lease import LeaseKeeper
from ._maintenance import Maintenance, MaintenanceConfig
from ._migrate import require_schema
from ._registry import DEFAULT_BACKOFF, DEFAULT_QUEUE, Context, Registry, TaskDef, registry
from ._sql import notify_channel, queries
from ._supervisor import LIVENESS_ENV, WORKER_ID_ENV

log = logging.getLogger("worker")

_WAKE = object()
# Longest an outcome waits to be acknowledged with others (unless a claim or stop comes first).
_MAX_ACK_DELAY = 0.02
# A handler is written off this long after its timeout (async ones are cancelled at the timeout).
_OVERDUE_MARGIN = 0.25
# Longest the main loop waits between two reconnection attempts after a database error.
_MAX_BACKOFF = 1.0


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
    worker_id: str | None = None  # default: $WORKER_ID (set by a supervisor), else a new uuid

    @property
    def heartbeat_seconds(self) -> float:
        return max(self.lease_seconds / 3, 0.05)

    @property
    def rescue_seconds(self) -> float:
        return max(self.lease_seconds / 4, 0.1)


@dataclass
class _Pending:
    """Finished jobs waiting to be acknowledged together."""

    jobs: list[Job] = field(default_factory=list)
    since: float = 0.0  # when the oldest waiting outcome arrived

    def add(self, job: Job) -> None:
        if not self.jobs:
            self.since = time.monotonic()
        self.jobs.append(job)

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)


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
        self.id = config.worker_id or os.environ.get(WORKER_ID_ENV) or str(uuid.uuid4())
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
        self.jobs: dict[int, Job] = {}  # token -> job, every job this process holds
        self._by_id: dict[int, Job] = {}  # task id -> job
        self._tokens = 0
        self._pending = _Pending()
        self._cursor = tr.ClaimCursor(config.cursor_reset_seconds)
        self._last_claim = 0.0
        self._queue_turn = 0
        self._conn: psycopg.Connection | None = None
        self._hooks_lock = threading.RLock()  # one counted transaction at a time (see counted)
        self.exit_code = 0
        self.pool: ConnectionPool | None = None  # for transactional handlers
        self._max_abandoned = config.max_abandoned or max(config.concurrency, 4)
        self._liveness = os.environ.get(LIVENESS_ENV)
        self._touched = 0.0
        self.executor = Executor(
            config.concurrency,
            self._events,
            context=self._context,
            transactional=self._run_transactional,
        )
        self.lease = LeaseKeeper(
            config.dsn,
            self.q,
            worker_id=self.id,
            lease_seconds=config.lease_seconds,
            interval=config.heartbeat_seconds,
            leased=self._leased,
            on_lost=lambda ids: self._events.put(("lost", ids)),
            prepare=config.prepare,
        )
        self.maintenance = Maintenance(
            config.dsn,
            self.q,
            MaintenanceConfig(
                rescue_seconds=config.rescue_seconds,
                purge_seconds=config.purge_interval,
                keep_done_seconds=config.keep_done_seconds,
                keep_failed_seconds=config.keep_failed_seconds,
                cron_keep_seconds=config.cron_keep_seconds,
            ),
            counted=self.counted,
            on_rescued=lambda rows: self.hooks.rescued(self, rows),
            on_cron=self._cron_enqueued,
            # Never offer a slot older than cron rows are kept: a purged slot could run again.
            cron=make_ticker(config.schema, horizon_seconds=config.cron_keep_seconds),
            prepare=config.prepare,
        )
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

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> int:
        cfg = self.config
        self.pool = ConnectionPool(
            cfg.dsn,
            min_size=0,
            max_size=cfg.concurrency,
            kwargs={"autocommit": True, "prepare_threshold": 5 if cfg.prepare else None},
            open=False,
            name=f"worker-{self.id[:8]}",
            timeout=5.0,
            check=ConnectionPool.check_connection,
        )
        self.pool.open()
        started: list[Any] = []
        try:
            conn = self._connection()
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
            for service in (self.executor, self.lease, self.maintenance):
                service.start()
                started.append(service)
            if cfg.listen:
                threading.Thread(target=self._listen, name="worker-listen", daemon=True).start()
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
            self._stop.set()
            for service in reversed(started):
                service.stop()
            self.pool.close(timeout=2)
            self._close()
            self.hooks.stopped(self)
        return self.exit_code

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        cfg = self.config
        backoff = 0.0
        more = True  # the last claim came back full: claim again without waiting
        while not self._stop.is_set():
            wait = 0.0 if more else self._wait_time()
            woken = self._collect(block=wait > 0, timeout=wait)
            try:
                now = time.monotonic()
                self._check_deadlines(now)
                ready = self._ready_to_claim() and not self._stop.is_set()
                pending = self._pending
                if (
                    pending
                    and not ready
                    and (
                        not self._active()
                        or len(pending) >= cfg.batch_size
                        or now - pending.since >= _MAX_ACK_DELAY
                    )
                ):
                    self._flush()
                more = False
                if ready:
                    claimed, more = self._claim()
                    if woken and claimed == 0:
                        # A NOTIFY may announce rows behind our cursor (a higher priority, say).
                        for q in self.queues:
                            self._cursor.reset(q, now)
                    if cfg.burst and claimed == 0 and not self.jobs:
                        break
                self._touch(now)
                backoff = 0.0
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                self._close()
                backoff = min(max(backoff * 2, 0.1), _MAX_BACKOFF)
                more = False
                self.hooks.db_error(self, exc)
                log.warning(
                    "database unavailable (%s); retrying in %.1fs",
                    str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__,
                    backoff,
                )
                # Retrying is not stuck: tell the supervisor so (see _supervisor), or an outage
                # longer than its stuck limit gets every worker process killed.
                self._touch(time.monotonic(), force=True)
                self._stop.wait(backoff)

    def _touch(self, now: float, *, force: bool = False) -> None:
        if self._liveness and (force or now - self._touched >= 1.0):
            with contextlib.suppress(OSError):
                os.utime(self._liveness)
            self._touched = now

    def _active(self) -> int:
        """Jobs that hold a slot: claimed or running on a runner that was not written off."""
        return sum(1 for j in self.jobs.values() if j.state in (State.CLAIMED, State.RUNNING))

    def _ready_to_claim(self) -> bool:
        """Claim when at least half a batch of slots is free, so claims stay large when tasks
        are short, or when nothing at all is running, or when free slots have waited a poll
        interval: long tasks free slots one at a time and may not free more for hours."""
        active = self._active()
        free = self.config.concurrency - active
        want = min(self.config.batch_size, self.config.concurrency)
        if free <= 0:
            return False
        if not active or free >= max(1, want // 2):
            return True
        return time.monotonic() - self._last_claim >= self.config.poll_interval

    def _wait_time(self) -> float:
        """Sleep until an outcome, a NOTIFY, the ack delay, a deadline or the poll interval."""
        now = time.monotonic()
        wait = self.config.poll_interval
        if self._pending:
            wait = min(wait, max(self._pending.since + _MAX_ACK_DELAY - now, 0.0))
        deadlines = [
            j.deadline for j in self.jobs.values() if j.deadline and j.state is State.RUNNING
        ]
        if deadlines:
            wait = min(wait, max(min(deadlines) - now, 0.0) + 0.01)
        return max(wait, 0.001)

    def _collect(self, *, block: bool, timeout: float) -> bool:
        """Take what the other threads reported; block for the first report when idle."""
        woken = False
        try:
            item = self._events.get(timeout=timeout) if block else self._events.get_nowait()
        except queue_mod.Empty:
            return False
        while True:
            if item is _WAKE:
                woken = True
            elif isinstance(item, Outcome):
                self._record(item)
            elif item[0] == "started":
                self._started(*item[1:])
            elif item[0] == "lost":
                self._lost(item[1])
            try:
                item = self._events.get_nowait()
            except queue_mod.Empty:
                return woken

    def _started(self, token: int, runner: int, at: float) -> None:
        job = self.jobs.get(token)
        if job is None or job.state is not State.CLAIMED:
            return
        job.state = State.RUNNING
        job.runner = runner
        timeout = job.definition.timeout
        job.deadline = at + timeout + _OVERDUE_MARGIN if timeout else None

    def _record(self, outcome: Outcome) -> None:
        job = self.jobs.get(outcome.token)
        if job is None:
            return
        c = job.claimed
        if job.lost:
            self._forget(job)
            log.warning(
                "task %d (%s) finished after its lease was lost; result discarded", c.id, c.task
            )
            return
        overdue = job.state is State.OVERDUE
        if overdue:
            log.warning(
                "task %d (%s): its handler came back %.1fs after it was written off",
                c.id,
                c.task,
                time.monotonic() - (job.deadline or time.monotonic()),
            )
            if not outcome.acked:
                # The attempt is recorded as timed out, whatever the handler came back with.
                outcome.ok, outcome.permanent = False, False
                outcome.error = (
                    f"TimeoutError: handler ran {outcome.duration:.1f}s, past its timeout of "
                    f"{job.definition.timeout:g}s"
                )
        self.hooks.finished(self, job.definition, c, outcome.ok, outcome.duration)
        if outcome.acked:
            self._forget(job)
            self.hooks.acked(self, "done", [c.id])
            self.done_count += 1
            return
        job.outcome = outcome
        job.state = State.FINISHED
        self._pending.add(job)

    def _lost(self, ids: list[int]) -> None:
        for task_id in ids:
            job = self._by_id.get(task_id)
            if job is None or job.lost or job.state is State.ACKING:
                continue  # acknowledged meanwhile: the row is not ours because we finished it
            job.lost = True
            log.warning(
                "lost task %d (%s): its lease expired and it was rescued; "
                "this worker will not complete it",
                job.id,
                job.claimed.task,
            )
            self.hooks.lost(self, job.claimed)
            if job.state is State.FINISHED:
                self._pending.jobs.remove(job)
                self._forget(job)

    def _forget(self, job: Job) -> None:
        self.jobs.pop(job.token, None)
        if self._by_id.get(job.id) is job:
            del self._by_id[job.id]

    def _leased(self) -> Iterable[tuple[int, int]]:
        """Called on the lease thread: the rows to renew."""
        return [(j.id, j.attempt) for j in list(self.jobs.values()) if j.state in LEASED]

    def _check_deadlines(self, now: float) -> None:
        """Write off handlers past their timeout: their rows stay leased until they return."""
        for job in list(self.jobs.values()):
            if job.state is not State.RUNNING or job.deadline is None or now <= job.deadline:
                continue
            job.state = State.OVERDUE
            self.executor.retire(job.runner)
            stuck = self.executor.retired
            log.error(
                "task %d (%s) exceeded its %gs timeout; its thread is written off and its row "
                "stays leased until it returns (%d stuck)",
                job.id,
                job.claimed.task,
                job.definition.timeout,
                stuck,
            )
            if stuck > self._max_abandoned:
                log.error(
                    "%d handler threads are stuck; stopping this process so it can be replaced",
                    stuck,
                )
                self.exit_code = 3
                self.stop(now=True)

    # -- acknowledging and claiming ----------------------------------------------------------

    @contextlib.contextmanager
    def counted(self, conn: psycopg.Connection) -> Iterator[None]:
        """A transaction whose events the hooks hear inside it, so that an observer can tie what
        it counts to the commit (see _hooks.Hooks.begin). One at a time per process: the main
        thread's claims and the maintenance thread's rescues take turns at the hooks."""
        hooks = self.hooks
        with self._hooks_lock:
            hooks.begin()
            try:
                with conn.transaction():
                    yield
                    hooks.prepare(self, conn)
            except BaseException:
                hooks.rollback()
                raise
            hooks.commit()

    def _flush(self) -> None:
        """Acknowledge on its own, when no claim is due to carry the acknowledgements."""
        if self._pending:
            self._claim(claim=False)

    def _claim(self, *, claim: bool = True) -> tuple[int, bool]:
        """Acknowledge what is pending and fill free slots, in one transaction.

        One commit per batch instead of two: with durable commits the WAL flush, not the SQL,
        is what a batch costs most. If anything fails, both roll back together: the finished
        jobs stay pending and the rows we tried to claim stay queued. One claim statement per
        queue, round-robin. Returns how many rows were claimed and whether a queue came back
        full (more may be waiting).
        """
        cfg = self.config
        free = cfg.concurrency - self._active() if claim else 0
        acking = self._pending.jobs
        self._pending = _Pending()
        for job in acking:
            job.state = State.ACKING
        claimed: list[tuple[str, float, int, list[tr.Claimed]]] = []
        if claim:
            self._last_claim = time.monotonic()
        conn = self._connection()
        try:
            with self.counted(conn):
                kept, states = self._ack(conn, acking)
                for i in range(len(self.queues) if claim else 0):
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
                self._report_acked(acking, kept, states)
                for _name, _now, _limit, rows in claimed:
                    if rows:
                        self.hooks.claimed(self, rows)
        except BaseException:
            for job in acking:  # not acknowledged: they wait for the next transaction
                if job.state is State.ACKING:
                    job.state = State.FINISHED
                    self._pending.add(job)
            raise
        self._acked(acking, kept, states)
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

    def _ack(self, conn: psycopg.Connection, jobs: list[Job]) -> tuple[set[int], dict[int, str]]:
        """Run the acknowledgement statements; the caller commits, then calls ``_acked``."""
        done = [(j.id, j.attempt) for j in jobs if j.outcome and j.outcome.ok]
        failures = [self._failure(j) for j in jobs if j.outcome and not j.outcome.ok]
        kept: set[int] = set()
        states: dict[int, str] = {}
        if done:
            delete = self.config.keep_done_seconds <= 0
            kept = tr.complete(conn, self.q, worker_id=self.id, done=done, delete=delete)
        if failures:
            states = tr.fail(conn, self.q, worker_id=self.id, failures=failures)
        return kept, states

    def _failure(self, job: Job) -> tr.Failure:
        c, outcome = job.claimed, job.outcome
        assert outcome is not None
        base = job.definition.retry_backoff if job.definition else DEFAULT_BACKOFF
        delay = retry_delay(c.attempt, base)
        return tr.Failure(c.id, c.attempt, delay, outcome.error or "", outcome.permanent)

    def _report_acked(self, jobs: list[Job], kept: set[int], states: dict[int, str]) -> None:
        """Inside the acknowledging transaction: tell the hooks what it changed."""
        if any(j.outcome and j.outcome.ok for j in jobs):
            self.hooks.acked(self, "done", [j.id for j in jobs if j.id in kept])
        if any(j.outcome and not j.outcome.ok for j in jobs):
            self.hooks.acked(self, "failed", states)

    def _acked(self, jobs: list[Job], kept: set[int], states: dict[int, str]) -> None:
        """After the commit: log, and forget the jobs."""
        for job in jobs:
            self._forget(job)
            outcome = job.outcome
            assert outcome is not None
            if outcome.ok and job.id in kept:
                self.done_count += 1
                self.last_ack = time.time()
            elif not outcome.ok and job.id in states:
                state = states[job.id]
                log.log(
                    logging.WARNING if state == "failed" else logging.INFO,
                    "task %d attempt %d %s: %s",
                    job.id,
                    job.attempt,
                    "failed for good" if state == "failed" else "will retry",
                    outcome.error.splitlines()[0] if outcome.error else "",
                )
            else:
                self._report_lost([job.id], "complete" if outcome.ok else "retry")

    def _report_lost(self, ids: Iterable[int], action: str) -> None:
        for task_id in ids:
            log.warning(
                "could not %s task %d: this worker no longer owns it (lease expired, rescued)",
                action,
                task_id,
            )

    def _dispatch(self, rows: list[tr.Claimed]) -> None:
        now = time.monotonic()
        for c in rows:
            self._tokens += 1
            definition = self.registry.get(c.task)
            job = Job(self._tokens, c, definition or _UNKNOWN, now, None)
            self.jobs[job.token] = job
            self._by_id[c.id] = job
            if definition is None:
                known = ", ".join(self.registry.names()) or "none"
                name = c.task if len(c.task) <= 200 else c.task[:200] + "..."
                error = (
                    f"UnknownTask: no handler named {name!r} is registered in this worker "
                    f"(known: {known[:1000]}); check the task name or deploy a worker that has it"
                )
                job.state = State.RUNNING
                self._record(Outcome(job.token, ok=False, error=error))
                continue
            self.executor.submit(job)

    def _cron_enqueued(self, n: int) -> None:
        with self._hooks_lock:
            self.hooks.cron_enqueued(self, n)

    # -- stopping ------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Acknowledge finished jobs as they come, for up to the grace period (their leases are
        renewed meanwhile), then hand back the rest without counting their attempt."""
        cfg = self.config
        now_only = self._stop_now.is_set()
        deadline = time.monotonic() + (0 if now_only else cfg.grace_seconds)
        if self._running():
            log.info(
                "stopping: waiting up to %.0fs for %d task(s)", cfg.grace_seconds, self._running()
            )
        delay = 0.1
        while True:
            self._collect(block=False, timeout=0)
            try:
                self._flush()
                delay = 0.1
            except psycopg.Error as exc:
                self._close()
                log.warning("could not acknowledge on stop (%s); retrying", _first_line(exc))
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            left = deadline - time.monotonic()
            if not self._running() and not self._pending:
                break
            if left <= 0 or self._stop_now.is_set():
                break
            self._collect(block=True, timeout=min(_MAX_ACK_DELAY * 5, left))
            self._check_deadlines(time.monotonic())
        self._hand_back()

    def _running(self) -> int:
        return sum(1 for j in self.jobs.values() if not j.lost and j.state is not State.FINISHED)

    def _hand_back(self) -> None:
        """Release unstarted and running jobs; leave overdue ones leased (their threads still run:
        the lease lapses when this process is gone, and a rescue records the attempt)."""
        back = [
            (j.id, j.attempt)
            for j in self.jobs.values()
            if not j.lost and j.state in (State.CLAIMED, State.RUNNING)
        ]
        for attempt in range(5):
            try:
                conn = self._connection()
                if self._pending:
                    self._flush()
                if back:
                    returned = tr.release(conn, self.q, worker_id=self.id, tasks=back)
                    log.warning("handed back %d unfinished task(s)", len(returned))
                    back = []
                conn.execute(self.q["unregister"], {"worker_id": self.id})
                break
            except psycopg.Error as exc:
                self._close()
                log.warning("could not settle tasks on stop (%s); retrying", _first_line(exc))
                time.sleep(min(0.5 * 2**attempt, 4))
        log.info("worker %s stopped", self.id[:8])

    # -- handlers that need the worker ---------------------------------------------------------

    def _context(self, job: Job, conn: psycopg.Connection | None = None) -> Context:
        c = job.claimed
        return Context(c.id, c.task, c.queue, c.attempt, c.max_attempts, self.id, conn)

    def _run_transactional(self, job: Job) -> None:
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

    # -- connections ---------------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        """The main thread's own connection, made again after an error (no pool backoff)."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.config.dsn,
                autocommit=True,
                connect_timeout=5,
                prepare_threshold=5 if self.config.prepare else None,
                application_name="worker",
            )
        return self._conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _listen(self) -> None:
        """Wake the main loop on NOTIFY. Optional: without it the worker polls."""
        dsn = self.config.listen_dsn or self.config.dsn
        channel = sql.Identifier(notify_channel(self.config.schema))
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(channel))
                    backoff = 0.5
                    self._events.put(_WAKE)  # rows may have come while we were not listening
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            self._events.put(_WAKE)
            except psycopg.Error as exc:
                log.info(
                    "listener disconnected (%s); polling until it reconnects", type(exc).__name__
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unknown_handler(payload: Any) -> None:  # pragma: no cover - never called
    raise RuntimeError("unknown task")


_UNKNOWN = TaskDef(name="<unknown>", fn=_unknown_handler)


def run_worker(config: WorkerConfig, tasks: Registry | None = None, **kwargs: Any) -> int:
    return Worker(config, tasks, **kwargs).run()


__all__ = ["Worker", "WorkerConfig", "format_error", "run_worker"]
