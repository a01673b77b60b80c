"""A batch of finished jobs, sorted by the statement that acknowledges each (see
Batcher.acknowledge): done without a result, done with one to store, done as a workflow step that
others wait for, failed (with when to try again), released by a stop, handed back."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..store import Failure
from ..tasks.backoff import retry_delay
from ..tasks.registry import DEFAULT_BACKOFF
from .job import Job


@dataclass
class Finished:
    done: list[tuple[int, int]] = field(default_factory=list)  # (id, attempt)
    with_result: list[tuple[int, int, str]] = field(default_factory=list)  # and its JSON
    step_results: list[tuple[int, int, str]] = field(default_factory=list)  # steps awaited
    failures: list[Failure] = field(default_factory=list)
    released: list[tuple[int, int]] = field(default_factory=list)
    handbacks: list[tuple[int, int, str]] = field(default_factory=list)  # and why
    carry: list[Job] = field(default_factory=list)  # the jobs that succeeded with a result

    @classmethod
    def of(cls, jobs: list[Job]) -> Finished:
        f = cls()
        for j in jobs:
            if (o := j.outcome) is None:
                continue
            if o.ok and o.result is None:
                f.done.append((j.id, j.attempt))
            elif o.ok and o.result is not None:
                f.carry.append(j)
                to = f.step_results if j.claimed.dependents else f.with_result
                to.append((j.id, j.attempt, o.result))
            elif o.released:
                f.released.append((j.id, j.attempt))
            elif o.handback:
                f.handbacks.append((j.id, j.attempt, o.error or ""))
            else:
                f.failures.append(failure(j))
        return f


def failure(job: Job) -> Failure:
    """The retry statement's view of a failed job: when to try again, and why it failed."""
    c, outcome = job.claimed, job.outcome
    assert outcome is not None
    base = job.definition.retry_backoff if job.definition else DEFAULT_BACKOFF
    return Failure(
        c.id,
        c.attempt,
        retry_delay(c.attempt, base),
        outcome.error or "",
        outcome.permanent,
        job.definition.max_attempts,
    )


__all__ = ["Finished", "failure"]
