"""One claimed task inside a worker process, as a small state machine.

    claimed ──▶ running ──▶ finished ──▶ acking ──▶ (gone: acknowledged)
                   │            ▲            │
                   ▼            │            └──▶ finished (the acknowledgement rolled back)
                overdue ────────┘  (a handler past its timeout; its thread came back)

    any state but acking ──▶ lost      (the lease thread found the row is no longer ours)
    claimed | running   ──▶ released   (a graceful stop handed it back)

A cancel request (``cancel``) is a flag, not a state: a claimed job then never starts, a running
one is told (its context's ``cancelled``; an async handler's task is cancelled), and the database
ends the row cancelled whatever outcome comes back.

The main thread moves a job between these states; the lease thread only reads them (which rows
to renew) and sets ``lost``. A job leaves the worker's table only once its row is acknowledged,
handed back, or lost, so a graceful stop knows exactly what it still holds.
"""

from __future__ import annotations

import enum
import json
import json.scanner
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from ..store import Claimed
from ..tasks.registry import TaskDef

MAX_ERROR_CHARS = 4000


class State(enum.Enum):
    CLAIMED = "claimed"  # waiting for a runner thread (or running, for a job with no timeout)
    RUNNING = "running"  # a runner thread has it
    OVERDUE = "overdue"  # running past its timeout; its thread is written off, its lease kept
    FINISHED = "finished"  # the outcome is here, not yet acknowledged
    ACKING = "acking"  # inside the acknowledging transaction


# States whose rows the lease thread keeps renewing. ACKING too: the acknowledging transaction may
# wait (for the hooks lock, a slow commit), and the heartbeat skips rows it has locked anyway.
LEASED = frozenset({State.CLAIMED, State.RUNNING, State.OVERDUE, State.FINISHED, State.ACKING})


@dataclass(slots=True)
class Outcome:
    """What running a handler came to, as a plain value: no I/O happens where it is made."""

    token: int
    ok: bool
    error: str | None = None
    permanent: bool = False
    duration: float = 0.0
    acked: bool = False  # transactional handlers complete their row themselves
    handback: bool = False  # no handler here: the row goes back uncounted (store.hand_back)
    released: bool = False  # stopped by a graceful stop: back to the queue, uncounted
    runner: int = -1  # which runner thread produced it
    result: str | None = None  # the return value as JSON, for tasks that store it (tasks.results)


@dataclass(slots=True)
class Job:
    token: int
    claimed: Claimed
    definition: TaskDef
    dispatched: float
    deadline: float | None
    state: State = State.CLAIMED
    lost: bool = False
    runner: int = -1  # the runner thread running it (RUNNING and OVERDUE)
    outcome: Outcome | None = None
    payload: Any = None  # decoded at dispatch from the claim's text (see decode_payload)
    committed: bool = False  # a transactional handler's transaction committed (set by its runner)
    cancel_requested: bool = False  # someone asked to cancel the task (set by the main thread)
    # (loop, asyncio task) of an async handler while it runs, so the main thread can cancel it
    # (set and cleared by its runner).
    aio: tuple[Any, Any] | None = None
    # A rate limit's pace: the monotonic times before which its handler must not start (0: now)
    # and after which it must not start any more (see store.Claimed.not_after).
    not_before: float = 0.0
    not_after: float = math.inf
    started: bool = False  # a runner started its handler (set under the runners' start lock)
    stop_requested: bool = False  # a graceful stop began: ctx.cancelled reads true
    # The row's id and attempt, copied from ``claimed``: read several times per task on the main
    # thread, where a property call each time showed in profiles.
    id: int = field(init=False)
    attempt: int = field(init=False)

    def __post_init__(self) -> None:
        self.id = self.claimed.id
        self.attempt = self.claimed.attempt


class MissedStart(Exception):
    """A rate limit's paced job reached its handler past ``not_after``: started now, it could
    crowd a window with the next starts of the pace. It goes back to the queue, uncounted."""

    MESSAGE = "MissedStart: the worker was too busy to start it on time"


def missed_start(job: Job) -> bool:
    """Whether a paced job is too late to start now (its runner must give it back instead)."""
    return bool(job.not_before) and time.monotonic() > job.not_after and not job.lost


class Pending:
    """Finished jobs waiting to be acknowledged together."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.since = 0.0  # when the oldest waiting outcome arrived

    def add(self, job: Job) -> None:
        if not self.jobs:
            self.since = time.monotonic()
        self.jobs.append(job)

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)


class JobTable:
    """Every job a worker process holds, and the only place their states change.

    Owned by the main thread; the lease thread reads ``leased()`` (a copy, taken atomically under
    the GIL). A job is in the table from its claim until its row is acknowledged, handed back or
    found lost, so "what does this process still hold?" always has one answer.
    """

    def __init__(self, overdue_margin: float) -> None:
        self.jobs: dict[int, Job] = {}  # token -> job
        self._by_id: dict[int, Job] = {}  # task id -> job
        self._tokens = 0
        self._margin = overdue_margin
        self.pending = Pending()
        # Kept as the states change, so the main loop's reads cost nothing per job (it reads
        # them on every wake-up, and wakes up for every outcome): jobs holding a slot, and the
        # running jobs that have a deadline.
        self._active = 0
        self._timed: dict[int, Job] = {}

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, claimed: Claimed, definition: TaskDef, now: float) -> Job:
        self._tokens += 1
        job = Job(self._tokens, claimed, definition, now, None)
        self.jobs[job.token] = job
        self._by_id[claimed.id] = job
        self._active += 1
        return job

    def started(self, token: int, runner: int, at: float) -> None:
        """claimed -> running; the timeout counts from here, not from the claim."""
        job = self.jobs.get(token)
        if job is None or job.state is not State.CLAIMED:
            return
        job.state = State.RUNNING
        job.runner = runner
        timeout = job.definition.timeout
        job.deadline = at + timeout + self._margin if timeout else None
        if job.deadline is not None:
            self._timed[token] = job

    def finish(self, outcome: Outcome) -> Job | None:
        """An outcome arrived: the job becomes finished (pending acknowledgement), or leaves the
        table when it acknowledged itself (transactional) or was lost meanwhile (check
        ``job.lost``). None when the job is not in the table."""
        job = self.jobs.get(outcome.token)
        if job is None:
            return None
        job.outcome = outcome
        if job.lost:
            self.forget(job)
            return job
        if job.state is State.OVERDUE and not outcome.acked:
            # The attempt is recorded as timed out, whatever the handler came back with.
            outcome.ok, outcome.permanent = False, False
            outcome.error = (
                f"TimeoutError: handler ran {outcome.duration:.1f}s, past its timeout of "
                f"{job.definition.timeout:g}s"
            )
        if outcome.acked:
            self.forget(job)
        else:
            self._leave(job)
            job.state = State.FINISHED
            self.pending.add(job)
        return job

    def lose(self, task_id: int, attempt: int) -> Job | None:
        """The lease keeper found the row is not ours at ``attempt``; returns the job if this is
        news. Not for another attempt of the same task (claimed again since the heartbeat read
        its list), nor for a job being acknowledged or whose own transaction committed."""
        job = self._by_id.get(task_id)
        if job is None or job.attempt != attempt or job.lost or job.committed:
            return None
        if job.state is State.ACKING:
            return None  # acknowledged meanwhile: the row is not ours because we finished it
        job.lost = True
        if job.state is State.FINISHED:
            self.pending.jobs.remove(job)
            self.forget(job)
        return job

    def cancel(self, task_id: int) -> Job | None:
        """Someone asked to cancel the task: flag its job if it has not finished; returns the job
        if this is news (the caller then stops its handler)."""
        job = self._by_id.get(task_id)
        if job is None or job.lost or job.cancel_requested or job.state not in _UNFINISHED:
            return None
        job.cancel_requested = True
        return job

    def holds(self, task_id: int) -> bool:
        """Whether a job of this task is in the table; safe from any thread (one dict read)."""
        return task_id in self._by_id

    def forget(self, job: Job) -> None:
        if self.jobs.pop(job.token, None) is not None and job.state is not State.ACKING:
            self._leave(job)  # (an acknowledged job left its slot when it finished)
        if self._by_id.get(job.id) is job:
            del self._by_id[job.id]

    def _leave(self, job: Job) -> None:
        """The job stops holding a slot or a deadline (it is about to change state, or go)."""
        state = job.state
        # The states of _ACTIVE, compared by identity: hashing an Enum member runs Python code,
        # and this runs for every task.
        if state is State.CLAIMED or state is State.RUNNING:
            self._active -= 1
        if self._timed:
            self._timed.pop(job.token, None)

    def overdue(self, now: float) -> list[Job]:
        """running -> overdue for handlers past their timeout (plus the margin)."""
        late = []
        for job in list(self._timed.values()):
            if job.state is State.RUNNING and job.deadline is not None and now > job.deadline:
                self._leave(job)
                job.state = State.OVERDUE
                late.append(job)
        return late

    def take_pending(self) -> list[Job]:
        """finished -> acking, for the next acknowledging transaction."""
        jobs, self.pending = self.pending.jobs, Pending()
        for job in jobs:
            job.state = State.ACKING
        return jobs

    def unack(self, jobs: list[Job]) -> None:
        """The acknowledging transaction failed: acking -> finished, pending again."""
        for job in jobs:
            if job.state is State.ACKING:
                job.state = State.FINISHED
                self.pending.add(job)

    # -- reads ---------------------------------------------------------------------------------

    def running_ids(self) -> list[int]:
        """Ids of the jobs whose handler has not come back; called from the lease thread."""
        return [j.id for j in list(self.jobs.values()) if j.state in _UNFINISHED]

    def leased(self) -> list[tuple[int, int]]:
        """(id, attempt) of the rows to renew; called from the lease thread."""
        return [(j.id, j.attempt) for j in list(self.jobs.values()) if j.state in LEASED]

    def active(self) -> int:
        """Jobs that hold a slot: claimed, or running on a runner that was not written off."""
        return self._active

    def unfinished(self) -> int:
        """Jobs whose handler has not come back yet (a graceful stop waits for these)."""
        return sum(1 for j in self.jobs.values() if not j.lost and j.state in _UNFINISHED)

    def next_deadline(self) -> float | None:
        times = [
            j.deadline for j in self._timed.values() if j.deadline and j.state is State.RUNNING
        ]
        return min(times) if times else None

    def to_hand_back(self) -> list[tuple[int, int]]:
        """Rows a stop may give back: claimed or running (see engine.stopping); overdue ones keep
        their lease."""
        return [
            (j.id, j.attempt)
            for j in self.jobs.values()
            if not j.lost and j.state in (State.CLAIMED, State.RUNNING)
        ]


_UNFINISHED = frozenset({State.CLAIMED, State.RUNNING, State.OVERDUE})
_ACTIVE = frozenset({State.CLAIMED, State.RUNNING})


# The C scanner under json.loads, called directly: json.loads first looks for whitespace around
# the value with regular expressions, which cost more than decoding a small payload, and the text
# PostgreSQL writes for a jsonb value has none.
_scan_once = json.scanner.make_scanner(json.JSONDecoder())


def decode_payload(raw: Any) -> Any:
    """The claim returns payloads as JSON text; each is decoded on its own, after the claim
    committed, so one that cannot be (nested thousands deep, a number of thousands of digits)
    fails its task alone. Raises whatever ``json.loads`` raises."""
    if type(raw) is str:
        try:
            value, end = _scan_once(raw, 0)
        except StopIteration:
            end = -1  # not JSON at its start: json.loads says why
        if end == len(raw):
            return value
    return json.loads(raw) if isinstance(raw, str | bytes) else raw


def decode_inputs(raw: str | None) -> list[Any]:
    """A workflow step's inputs as the claim returns them (JSON text of a list, or None for a
    step that waited for nothing): the list its handler reads as ``ctx.inputs``."""
    if raw is None:
        return []
    value = decode_payload(raw)
    return value if isinstance(value, list) else [value]


def display(name: str, limit: int = 200) -> str:
    """A producer-written name (task, queue) as logs may show it: bounded, no control codes."""
    text = name if len(name) <= limit else f"{name[:limit]}...[{len(name) - limit} more]"
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def format_error(exc: BaseException, *, frames: int = 5) -> str:
    """``Type: message`` then the last few traceback frames: enough to find the line, bounded."""
    head = f"{type(exc).__name__}: {exc}"
    tail = "".join(traceback.format_tb(exc.__traceback__)[-frames:])
    text = f"{head}\n{tail}".rstrip() if tail else head
    return clean_text(text)


def clean_text(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Text the database and a terminal can take: no NUL, no lone surrogate, bounded."""
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        text = text[: limit - 20] + f"... [{len(text) - limit + 20} more]"
    return text


__all__ = [
    "LEASED",
    "Job",
    "JobTable",
    "Outcome",
    "Pending",
    "State",
    "clean_text",
    "decode_payload",
    "display",
    "format_error",
]
