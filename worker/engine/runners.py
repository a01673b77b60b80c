"""Runner threads: they run handlers and turn what happened into an ``Outcome``, nothing else.

A runner takes a job from the work queue, calls its handler (sync, ``async def`` on the runner's
own event loop, or inside a transaction for ``transactional=True``), and puts the outcome on the
events queue of the main thread. Runners never talk to the database about task state, with one
exception: a transactional handler completes its own row in its own transaction.

A handler past its timeout cannot be stopped from outside its thread. The main thread then
*retires* that runner (``retire``) and starts another in its place, so the slot is not lost; the
retired runner finishes its job, reports it, and exits. Async handlers are cancelled at their
timeout by ``asyncio.wait_for``; one that ignores cancellation (it blocks its loop) is retired
like a stuck sync handler.

A cancel request (see ``coord.cancel``) reaches a handler the same ways: an async handler's task is
cancelled (``cancel``, called by the main thread), a sync one sees ``ctx.cancelled`` and
``ctx.check()`` raises ``Cancelled``. A job cancelled before a runner took it never starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as queue_mod
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .. import hooks as _hooks
from ..errors import Cancelled, DoNotRetry
from ..tasks.registry import Context, TaskDef
from ..tasks.results import encode_result
from .job import Job, MissedStart, Outcome, format_error, missed_start

log = logging.getLogger("worker")

# Runs a transactional handler in the transaction that completes its row (see Worker).
TransactionalRun = Callable[[Job], None]
MakeContext = Callable[[Job], Context]
# Whether a handler's return value is stored (see tasks.results), decided by the worker's settings.
StoresResult = Callable[[TaskDef], bool]


class Reports(Protocol):
    """Where runners report to the main thread (``engine.inbox.Inbox``)."""

    def put(self, item: Any) -> None: ...


class Executor:
    """Up to ``concurrency`` runner threads, plus replacements for retired ones.

    Threads start when work needs them (a job waits and no runner is idle), so a large
    concurrency costs nothing until the queue is busy enough to use it.
    """

    def __init__(
        self,
        concurrency: int,
        events: Reports,
        *,
        context: MakeContext,
        transactional: TransactionalRun,
        stores_result: StoresResult = lambda d: False,
        max_result_bytes: int = 64 * 1024,
    ) -> None:
        self.concurrency = concurrency
        self._events = events
        self._work: queue_mod.SimpleQueue[Job | None] = queue_mod.SimpleQueue()
        self._context = context
        self._transactional = transactional
        self._stores_result = stores_result
        self._max_result_bytes = max_result_bytes
        # id(TaskDef) -> (the TaskDef, whether its return value is stored): the answer never
        # changes, and hashing a TaskDef (a frozen dataclass) would cost more than asking each
        # time. The TaskDef is kept so its id cannot be reused by another.
        self._stores: dict[int, tuple[TaskDef, bool]] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._retired: set[int] = set()
        self._next = 0
        self._idle = 0  # runners waiting for work
        self._lock = threading.Lock()
        # Taken to start a handler, and by a stop to decide which jobs never will: a job is
        # either started or given back, never both.
        self.start_lock = threading.Lock()

    def start(self) -> None:
        """Runners start with the first jobs (see submit)."""

    def submit_many(self, jobs: list[Job]) -> None:
        """Queue jobs for the runners, starting runners for those no idle runner will take."""
        with self._lock:
            # An idle runner is reserved for each job as it is queued, so the count is exact
            # however the threads interleave: no job waits while a slot could start a thread.
            reserved = min(self._idle, len(jobs))
            self._idle -= reserved
            room = self.concurrency - (len(self._threads) - len(self._retired))
            grow = max(min(len(jobs) - reserved, room), 0)
        put = self._work.put
        for job in jobs:
            put(job)
        for _ in range(grow):
            self._start_runner(reserved=True)

    def retire(self, runner: int) -> None:
        """The runner's job is past its timeout: write the thread off and start another."""
        with self._lock:
            if runner in self._retired or runner not in self._threads:
                return
            self._retired.add(runner)
        self._start_runner()

    @property
    def retired(self) -> int:
        """Runner threads written off and still running their job."""
        with self._lock:
            return len(self._retired)

    def stop(self) -> None:
        """Tell idle runners to exit (busy ones exit after their job; they are daemons)."""
        with self._lock:
            n = len(self._threads)
        for _ in range(n):
            self._work.put(None)

    # -- the runner thread -------------------------------------------------------------------------

    def _start_runner(self, *, reserved: bool = False) -> None:
        """``reserved``: a job was queued for this runner (it is not idle when it starts)."""
        with self._lock:
            number = self._next
            self._next += 1
            t = threading.Thread(
                target=self._run,
                args=(number, reserved),
                name=f"worker-run-{number}",
                daemon=True,
            )
            self._threads[number] = t
        t.start()

    def _run(self, number: int, reserved: bool) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        try:
            while True:
                if not reserved:
                    with self._lock:
                        self._idle += 1  # taken back by the submit that hands us a job
                reserved = False
                job = self._work.get()
                if job is None:
                    return
                if job.not_before:
                    _wait_for_start(job)  # a rate limit's pace (see store.Claimed)
                    if missed_start(job):
                        # Too late for its place in the pace: started now, it could crowd a
                        # window with the next starts. It goes back, uncounted, for a later one.
                        # (A transactional handler checks again once its transaction is open.)
                        error = MissedStart.MESSAGE
                        self._events.put(
                            Outcome(job.token, ok=False, error=error, released=True, runner=number)
                        )
                        continue
                with self.start_lock:
                    job.started = not job.lost and not job.cancel_requested
                if job.lost:  # rescued, or given back by a stop, before it started
                    self._events.put(Outcome(job.token, ok=False, error="lost", runner=number))
                    continue
                if job.cancel_requested:  # cancelled while it waited for a runner
                    error = "Cancelled: cancelled before its handler started"
                    self._events.put(
                        Outcome(job.token, ok=False, error=error, permanent=True, runner=number)
                    )
                    continue
                job.runner = number
                if job.definition.timeout:
                    # Tells the main thread a runner started it: the deadline counts from here,
                    # not from the claim (a job may wait for a free runner). Only jobs with a
                    # timeout need it; for the others "claimed" and "running" are the same to
                    # the main thread, and this saves it an event per task.
                    self._events.put(("started", job.token, number, time.monotonic()))
                if job.definition.is_async and loop is None:
                    loop = asyncio.new_event_loop()
                outcome = self._execute(job, loop)
                outcome.runner = number
                self._events.put(outcome)
                if self._retired:  # (read without the lock first: almost always empty)
                    with self._lock:
                        if number in self._retired:
                            self._retired.discard(number)
                            return  # replaced while it ran: the replacement serves the queue
        finally:
            with self._lock:
                self._threads.pop(number, None)
            if loop is not None:
                loop.close()

    def _execute(self, job: Job, loop: asyncio.AbstractEventLoop | None) -> Outcome:
        d = job.definition
        start = time.perf_counter()
        outcome = Outcome(job.token, ok=True)
        payload = job.payload  # decoded by the main thread at dispatch (see Worker._dispatch)
        # Run observers (tracing, see worker.hooks) cost one truth test here and one below when none
        # is registered.
        observed = _hooks.start_runs(job) if _hooks.runs else None
        failure: BaseException | None = None
        try:
            if d.transactional:
                self._transactional(job)  # stores its own result (see Worker)
                job.committed = True  # before the outcome is posted: it is no longer "lost"
                outcome.acked = True
            else:
                if d.is_async:
                    assert loop is not None
                    coro = d.fn(payload, self._context(job)) if d.wants_context else d.fn(payload)
                    if d.timeout:
                        coro = asyncio.wait_for(coro, d.timeout)
                    task = loop.create_task(coro)
                    job.aio = (loop, task)
                    if job.cancel_requested:  # the request came before ``aio`` was set: see cancel
                        task.cancel()
                    try:
                        value = loop.run_until_complete(task)
                    finally:
                        job.aio = None
                elif d.wants_context:
                    value = d.fn(payload, self._context(job))
                else:
                    value = d.fn(payload)
                known = self._stores.get(id(d))  # decided once per handler (see __init__)
                if known is None or known[0] is not d:
                    known = self._stores[id(d)] = (d, self._stores_result(d))
                # A workflow's step others wait for passes its result on (None too): its
                # acknowledgement (complete_with_result) also marks it settled.
                if known[1] or job.claimed.dependents:
                    # Encoded here, off the main thread; a value that cannot be stored fails
                    # the task at once (ResultError is a DoNotRetry).
                    outcome.result = encode_result(value, self._max_result_bytes)
        except MissedStart:  # a transactional handler's transaction opened too late to start
            outcome.ok, outcome.released, outcome.error = False, True, MissedStart.MESSAGE
        except Cancelled as exc:
            outcome.ok, outcome.error = False, format_error(exc)
            if job.stop_requested and not job.cancel_requested:
                outcome.released = True  # stopped by a graceful stop: back, uncounted
            else:
                outcome.permanent = True
            failure = exc
        except DoNotRetry as exc:
            outcome.ok, outcome.permanent, outcome.error = False, True, format_error(exc)
            failure = exc
        except asyncio.CancelledError as exc:
            failure = exc
            outcome.ok, outcome.permanent = False, job.cancel_requested
            outcome.error = (
                "Cancelled: the handler was cancelled at a cancel request"
                if job.cancel_requested
                else format_error(exc)
            )
        except TimeoutError as exc:
            failure = exc
            outcome.ok = False
            outcome.error = (
                f"TimeoutError: handler ran longer than its timeout of {d.timeout:g}s"
                if d.is_async and d.timeout
                else format_error(exc)
            )
        except BaseException as exc:  # a handler's SystemExit must not kill the worker
            outcome.ok, outcome.error = False, format_error(exc)
            failure = exc
        outcome.duration = time.perf_counter() - start
        if observed:
            _hooks.end_runs(observed, job, outcome, failure)
        # As ``except ... as`` does: no cycle frame -> exception -> traceback -> frame is left.
        failure = None
        return outcome


def _wait_for_start(job: Job) -> None:
    """Wait until the moment a rate limit's pace lets the job start, or until it is lost or
    cancelled meanwhile (the caller then reports it as for a job that never started)."""
    while (left := job.not_before - time.monotonic()) > 0:
        if job.lost or job.cancel_requested:
            return
        time.sleep(min(left, 0.05))


def cancel(job: Job) -> None:
    """Stop the handler of a job just flagged ``cancel_requested`` (on the main thread): an async
    handler's task is cancelled on its loop; a sync handler reads the flag itself."""
    aio = job.aio
    if aio is None:
        return  # sync, not started, or its runner cancels the task itself (see _execute)
    loop, task = aio
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the task is over
        loop.call_soon_threadsafe(task.cancel)


__all__ = ["Executor", "cancel"]
