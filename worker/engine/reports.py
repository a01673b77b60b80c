"""What the other threads report to the main loop, and what each report means for the jobs
of this process: an outcome (the job is finished), a lost lease (its result will be discarded),
a cancel request (its handler is told), and a handler past its timeout (its thread is written
off). Only the main thread runs these (``Worker.collect``), so they move jobs between states
without locks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .job import Job, Outcome, State, display
from .runners import cancel

if TYPE_CHECKING:
    from .loop import Worker

log = logging.getLogger("worker")


def record(w: Worker, outcome: Outcome) -> None:
    """A runner's outcome: the job is finished (or was lost, or written off meanwhile)."""
    before = w.table.jobs.get(outcome.token)
    overdue = before is not None and before.state is State.OVERDUE
    job = w.table.finish(outcome)
    if job is None:
        return
    c = job.claimed
    if job.lost:
        log.warning(
            "task %d (%s) finished after its lease was lost; result discarded",
            c.id,
            display(c.task),
        )
        return
    if overdue:
        log.warning(
            "task %d (%s): its handler came back after it was written off",
            c.id,
            display(c.task),
        )
    w.hooks.finished(w, job.definition, c, outcome.ok, outcome.duration)
    if c.dependents and not outcome.acked:
        # A workflow step others wait for: its acknowledgement may release them. Claim in the
        # same transaction, so the next step starts then, not after the notification's round.
        w.batcher.mark([c.queue])
    if outcome.acked:
        w.hooks.acked(w, "done", [c.id])
        w.done_count += 1


def lost(w: Worker, pairs: list[tuple[int, int]]) -> None:
    """The lease keeper found these rows are no longer ours: their results will be discarded."""
    for task_id, attempt in pairs:
        job = w.table.lose(task_id, attempt)
        if job is None:
            continue
        log.warning(
            "lost task %d (%s): its lease expired and it was rescued; "
            "this worker will not complete it",
            job.id,
            display(job.claimed.task),
        )
        w.hooks.lost(w, job.claimed)


def cancel_requested(w: Worker, ids: list[int]) -> None:
    """Someone asked to cancel these tasks: stop the handlers of those still running here.
    The rows end cancelled whatever the handlers do (see complete in store/acks.sql)."""
    for task_id in ids:
        job = w.table.cancel(task_id)
        if job is None:
            continue  # not ours, or its handler already came back
        log.info(
            "task %d (%s): cancel requested; %s",
            job.id,
            display(job.claimed.task),
            "cancelling its handler"
            if job.definition.is_async
            else "its handler sees ctx.cancelled",
        )
        cancel(job)


def check_deadlines(w: Worker, now: float) -> None:
    """Write off handlers past their timeout: their rows stay leased until they return."""
    for job in w.table.overdue(now):
        w.executor.retire(job.runner)
        stuck = w.executor.retired
        log.error(
            "task %d (%s) exceeded its %gs timeout; its thread is written off and its row "
            "stays leased until it returns (%d stuck)",
            job.id,
            display(job.claimed.task),
            job.definition.timeout,
            stuck,
        )
        if stuck > w.max_abandoned:
            log.error(
                "%d handler threads are stuck; stopping this process so it can be replaced",
                stuck,
            )
            w.exit_code = 3
            w.stop(now=True)


def log_acknowledged(jobs: list[Job], kept: dict[int, str], states: dict[int, str]) -> int:
    """After the commit: say what happened to each job; returns how many completed."""
    completed = 0
    for job in jobs:
        outcome = job.outcome
        assert outcome is not None
        if outcome.ok and kept.get(job.id) == "done":
            completed += 1
        elif outcome.ok and job.id in kept:
            log.info(
                "task %d attempt %d cancelled: its handler finished after the cancel request, "
                "so its result is not recorded",
                job.id,
                job.attempt,
            )
        elif not outcome.ok and job.id in states:
            state = states[job.id]
            log.log(
                logging.WARNING if state == "failed" else logging.INFO,
                "task %d attempt %d %s: %s",
                job.id,
                job.attempt,
                {
                    "failed": "failed for good",
                    "handed_back": "handed back",
                    "released": "given back to the queue by the stop (its attempt not counted)",
                    "cancelled": "cancelled",
                }.get(state, "will retry"),
                outcome.error.splitlines()[0] if outcome.error else "",
            )
        else:
            log.warning(
                "could not %s task %d: this worker no longer owns it (lease expired, rescued)",
                "complete" if outcome.ok else "retry",
                job.id,
            )
    return completed


__all__ = ["cancel_requested", "check_deadlines", "log_acknowledged", "lost", "record"]
