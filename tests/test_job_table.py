"""The job table keeps its slot count and deadlines as states change (the main loop reads them on
every wake-up). Random sequences of what the worker does to it (claims, starts, outcomes,
time-outs, lost leases, acknowledgements that commit or fail) must leave them equal to counting
the jobs one by one."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.job import JobTable, Outcome, State
from worker.store import Claimed
from worker.tasks.registry import TaskDef

_NOW = datetime(2026, 1, 1, tzinfo=UTC)
_TIMED = TaskDef("timed", lambda p: None, timeout=1.0)
_PLAIN = TaskDef("plain", lambda p: None)

ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["claim", "start", "finish", "finish_acked", "overdue", "lose", "ack", "unack"]
        ),
        st.integers(min_value=0, max_value=30),
        st.booleans(),
    ),
    min_size=10,
    max_size=150,
)


def _counted(table: JobTable) -> int:
    return sum(1 for j in table.jobs.values() if j.state in (State.CLAIMED, State.RUNNING))


def _deadline(table: JobTable) -> float | None:
    times = [j.deadline for j in table.jobs.values() if j.deadline and j.state is State.RUNNING]
    return min(times) if times else None


@settings(max_examples=300, deadline=None)
@given(ops)
def test_counts_kept_as_states_change_equal_counting_the_jobs(steps) -> None:
    table = JobTable(overdue_margin=0.0)
    next_id = 1
    clock = 0.0
    acking: list = []
    for op, pick, flag in steps:
        clock += 0.4  # a started timed job is overdue three steps later
        wanted = {
            "start": (State.CLAIMED,),
            "finish": (State.CLAIMED, State.RUNNING, State.OVERDUE),
            "finish_acked": (State.CLAIMED, State.RUNNING, State.OVERDUE),
        }.get(op, tuple(State))
        fitting = [j for j in table.jobs.values() if j.state in wanted]
        job = fitting[pick % len(fitting)] if fitting else None
        if op == "claim":
            c = Claimed(next_id, "t", "{}", 1, 5, "q", 0, _NOW, _NOW, _NOW)
            table.add(c, _TIMED if flag else _PLAIN, clock)
            next_id += 1
        elif op == "start" and job is not None:
            table.started(job.token, 1, clock)
        elif op in ("finish", "finish_acked") and job is not None:
            table.finish(Outcome(job.token, ok=flag, acked=op == "finish_acked"))
        elif op == "overdue":
            table.overdue(clock)
        elif op == "lose" and job is not None:
            table.lose(job.id, job.attempt)
        elif op == "ack":
            acking = table.take_pending()
            if flag:  # the acknowledging transaction committed
                for j in acking:
                    table.forget(j)
                acking = []
        elif op == "unack" and acking:
            table.unack(acking)
            acking = []
        assert table.active() == _counted(table)
        assert table.next_deadline() == _deadline(table)
