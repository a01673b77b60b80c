"""Workflows: declared in Python or SQL, refused with one line when they cannot run, and run by
workers with the queue's guarantees. The adversarial cases use real `worker run` processes and
real signals; every step run is recorded in `runs` (tests/flows_module.py), so a test checks that
a join ran exactly once, with its inputs in order, and that no step ran twice at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import flows_module as fm
import psutil
import psycopg
import pytest
from conftest import run_cli, spawn_cli, states, wait_until
from psycopg.types.json import Jsonb
from test_pool import child_pids, kill_tree, live_workers
from test_runtime import overlapping_runs

import worker
import worker.testing
from worker import store as worker_store

FINAL = ("done", "failed", "cancelled")


@pytest.fixture
def recorded(pg_dsn: str, schema: str, conn: psycopg.Connection) -> Iterator[str]:
    """The handlers of flows_module record their runs in this schema."""
    fm.make_runs(conn, schema)
    saved = {k: os.environ.get(k) for k in ("WORKER_DSN", "WORKER_SCHEMA")}
    os.environ["WORKER_DSN"], os.environ["WORKER_SCHEMA"] = pg_dsn, schema
    yield schema
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def pool(dsn: str, schema: str, *flags: str) -> Iterator[subprocess.Popen]:
    proc = spawn_cli(
        "run",
        "flows_module",
        "--schema",
        schema,
        *flags,
        env={"WORKER_DSN": dsn, "WORKER_SCHEMA": schema},
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        kill_tree(proc)


def unfinished(conn: psycopg.Connection, schema: str) -> int:
    return conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE state NOT IN ('done', 'failed', 'cancelled')"
    ).fetchone()[0]


def row(conn: psycopg.Connection, schema: str, task_id: int) -> tuple:
    return conn.execute(
        f"SELECT state::text, result, inputs, last_error FROM {schema}.tasks WHERE id = %s",
        (task_id,),
    ).fetchone()


def runs_of(conn: psycopg.Connection, schema: str, task_id: int) -> list[tuple]:
    return conn.execute(
        f"SELECT attempt, pid, inputs FROM {schema}.runs WHERE task_id = %s ORDER BY run",
        (task_id,),
    ).fetchall()


# -- declared, and refused ---------------------------------------------------------------------


def test_run_workflow_runs_steps_in_dependency_order_without_a_database() -> None:
    chain = worker.chain(
        worker.step(fm.noop_sum, {"n": 1}),
        worker.step(fm.noop_sum, {"n": 10}),
        worker.step(fm.noop_sum, {"n": 100}),
    )
    run = worker.testing.run_workflow(chain).check()
    assert [r.result for r in run.steps] == [1, 11, 111]
    assert [r.inputs for r in run.steps] == [[], [1], [11]]

    chord = worker.group(
        [worker.step(fm.noop_sum, {"n": n}) for n in range(5)],
        then=worker.step(fm.noop_sum, {"n": 0}),
    )
    assert worker.testing.run_workflow(chord).check().steps[-1].result == 10

    flow = worker.Workflow("policy")
    bad = flow.add(fm.fail, {"why": "no disk"})
    skipped = flow.add(fm.noop_sum, depends_on=[bad])
    after_skipped = flow.add(fm.noop_sum, depends_on=[skipped])
    anyway = flow.add(fm.noop_sum, {"n": 7}, depends_on=[worker.after(bad, run_on_failure=True)])
    run = worker.testing.run_workflow(flow)
    assert run[bad].state == "failed" and "no disk" in (run[bad].error or "")
    assert run[skipped].state == "cancelled" and run[after_skipped].state == "cancelled"
    assert (run[anyway].state, run[anyway].inputs, run[anyway].result) == ("done", [None], 7)
    with pytest.raises(AssertionError, match="did not finish"):
        run.check()


def test_a_cycle_a_self_edge_and_a_step_of_another_workflow_are_refused_in_one_line() -> None:
    flow = worker.Workflow("loop")
    a = flow.add(fm.noop_sum, key="a")
    b = flow.add(fm.noop_sum, key="b", depends_on=[a])
    c = flow.add(fm.noop_sum, key="c", depends_on=[b])
    a.after(c)
    with pytest.raises(worker.WorkflowError) as cycle:
        worker.enqueue_workflow("postgresql://nowhere.invalid/x", flow)
    assert str(cycle.value) == "workflow 'loop': dependency cycle: a -> b -> c -> a"

    selfish = worker.Workflow()
    s = selfish.add(fm.noop_sum, key="s")
    s.after(s)
    with pytest.raises(worker.WorkflowError, match=r"^step 's' depends on itself$"):
        selfish.order()

    other = worker.Workflow()
    outsider = worker.step(fm.noop_sum, key="outsider")
    mine = worker.Workflow("mine")
    mine.add(fm.noop_sum, key="x", depends_on=[outsider])
    with pytest.raises(worker.WorkflowError) as missing:
        mine.order()
    assert "\n" not in str(missing.value)
    assert "depends on step 'outsider', which is not in this workflow" in str(missing.value)
    other.add(outsider)
    with pytest.raises(worker.WorkflowError, match="not in this workflow"):
        mine.order()


def test_hostile_edges_inserted_by_sql_fail_alone_and_hold_up_nothing(
    recorded: str, conn: psycopg.Connection, thread_worker
) -> None:
    """Edges to a missing step, to a step of another workflow, to itself, to a later step (a
    cycle), from a plain task, onto a running step: each INSERT fails with one line naming the
    edge; the workflow next to them drains."""
    schema = recorded
    wf1 = conn.execute(
        f"SELECT {schema}.create_workflow(%s, 'one')",
        (
            Jsonb(
                [
                    {"key": "a", "task": "wf.add", "payload": {"n": 1}},
                    {"key": "b", "task": "wf.add", "depends_on": ["a"]},
                ]
            ),
        ),
    ).fetchone()[0]
    wf2 = conn.execute(
        f"SELECT {schema}.create_workflow(%s, 'two')",
        (
            Jsonb(
                [
                    {"key": "x", "task": "wf.add", "payload": {"n": 5}},
                    {"key": "y", "task": "wf.add", "depends_on": ["x"]},
                ]
            ),
        ),
    ).fetchone()[0]
    a, b = [
        r[0]
        for r in conn.execute(
            f"SELECT id FROM {schema}.tasks WHERE workflow_id = %s ORDER BY id", (wf1,)
        )
    ]
    x, y = [
        r[0]
        for r in conn.execute(
            f"SELECT id FROM {schema}.tasks WHERE workflow_id = %s ORDER BY id", (wf2,)
        )
    ]
    plain = conn.execute(f"INSERT INTO {schema}.tasks (task) VALUES ('wf.noop') RETURNING id")
    plain_id = plain.fetchone()[0]
    hostile = {
        (b, 10**9): f"workflow edge {b} -> {10**9}: task {10**9} does not exist",
        (b, x): f"step {b} of workflow {wf1} cannot depend on task {x} of workflow {wf2}",
        (b, b): f"workflow step {b} cannot depend on itself",
        (a, b): f"workflow edge {a} -> {b}: a step depends only on steps inserted before it",
        (plain_id, a): f"task {plain_id} is not a workflow step",
    }
    for (child, parent), message in hostile.items():
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(
                f"INSERT INTO {schema}.task_deps (task_id, depends_on) VALUES (%s, %s)",
                (child, parent),
            )
        assert message in str(refused.value).splitlines()[0], str(refused.value)
    with pytest.raises(psycopg.Error, match="depends on itself"):
        conn.execute(
            f"SELECT {schema}.create_workflow(%s)",
            (Jsonb([{"key": "s", "task": "wf.add", "depends_on": ["s"]}]),),
        )
    with pytest.raises(psycopg.Error, match="which is not listed before it"):
        conn.execute(
            f"SELECT {schema}.create_workflow(%s)",
            (
                Jsonb(
                    [
                        {"key": "p", "task": "wf.add", "depends_on": ["q"]},
                        {"key": "q", "task": "wf.add", "depends_on": ["p"]},
                    ]
                ),
            ),
        )
    # A waiting step inserted by SQL with nothing to wait for is released by the sweep.
    orphan = conn.execute(
        f"INSERT INTO {schema}.tasks (task, workflow_id, state) VALUES ('wf.add', %s, 'waiting')"
        " RETURNING id",
        (wf2,),
    ).fetchone()[0]
    with thread_worker(worker.registry, lease_seconds=2.0):
        wait_until(lambda: unfinished(conn, schema) == 0, timeout=30)
    # Results are kept only where a step waits for them (a, x): b and y store none.
    assert row(conn, schema, b)[:3] == ("done", None, [1])
    assert row(conn, schema, y)[:3] == ("done", None, [5])
    assert row(conn, schema, orphan)[0] == "done"
    assert row(conn, schema, plain_id)[0] == "done"


def test_an_edge_onto_a_running_step_claimed_without_dependents_is_refused(
    recorded: str, conn: psycopg.Connection
) -> None:
    schema = recorded
    wf = conn.execute(f"INSERT INTO {schema}.workflows DEFAULT VALUES RETURNING id").fetchone()[0]
    parent, child = [
        r[0]
        for r in conn.execute(
            f"INSERT INTO {schema}.tasks (task, workflow_id) VALUES ('wf.add', %s), ('wf.add', %s)"
            " RETURNING id",
            (wf, wf),
        )
    ]
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'in_progress', lease_expires_at = now() + '1 min',"
        " attempts = 1 WHERE id = %s",
        (parent,),
    )
    with pytest.raises(psycopg.Error, match=f"step {parent} is running, and was claimed without"):
        conn.execute(
            f"INSERT INTO {schema}.task_deps (task_id, depends_on) VALUES (%s, %s)",
            (child, parent),
        )


# -- run by workers --------------------------------------------------------------------------------


def test_chain_chord_and_a_graph_with_a_failure_policy(
    recorded: str, conn: psycopg.Connection, thread_worker
) -> None:
    schema = recorded
    chain = worker.chain(
        worker.step(fm.add, {"n": 1}),
        worker.step(fm.add, {"n": 10}),
        worker.step(fm.add, {"n": 100}),
    )
    c = worker.enqueue_workflow(conn, chain, schema=schema)
    chord = worker.group(
        [worker.step(fm.add, {"n": n}) for n in range(20)], then=worker.step(fm.collect)
    )
    j = worker.enqueue_workflow(conn, chord, schema=schema)
    flow = worker.Workflow("policy")
    bad = flow.add(fm.fail, {"why": "no disk"})
    skipped = flow.add(fm.add, depends_on=[bad])
    deeper = flow.add(fm.add, depends_on=[skipped])
    anyway = flow.add(fm.collect, depends_on=[worker.after(bad, run_on_failure=True)])
    g = worker.enqueue_workflow(conn, flow, schema=schema)
    assert row(conn, schema, g[skipped])[0] == "waiting"
    with thread_worker(worker.registry, concurrency=8):
        wait_until(lambda: unfinished(conn, schema) == 0, timeout=30)
    assert [row(conn, schema, c[s])[:3] for s in chain.steps] == [
        ("done", 1, None),
        ("done", 11, [1]),
        ("done", None, [11]),
    ]
    assert row(conn, schema, j[chord.steps[-1]])[:3] == ("done", None, list(range(20)))
    assert row(conn, schema, g[bad])[0] == "failed"
    state, _, _, error = row(conn, schema, g[skipped])
    assert (state, error) == (
        "cancelled",
        f"DependencyFailed: step {g[bad]} (wf.fail) ended failed",
    )
    assert row(conn, schema, g[deeper])[0] == "cancelled"
    assert row(conn, schema, g[anyway])[:3] == ("done", None, [None])
    assert runs_of(conn, schema, g[skipped]) == []

    # An operator's retry of the failed step resumes the workflow from there.
    conn.execute(f"UPDATE {schema}.tasks SET task = 'wf.add' WHERE id = %s", (g[bad],))
    assert conn.execute(f"SELECT requeued FROM {schema}.requeue(%s)", ([g[bad]],)).fetchone() == (
        [g[bad]],
    )
    assert row(conn, schema, g[skipped])[0] == "waiting"
    with thread_worker(worker.registry):
        wait_until(lambda: unfinished(conn, schema) == 0, timeout=30)
    assert [row(conn, schema, g[s])[0] for s in (bad, skipped, deeper)] == ["done"] * 3
    assert len(runs_of(conn, schema, g[anyway])) == 1  # it ran once, at the failure


def test_a_worker_that_keeps_no_finished_rows_still_releases_the_next_steps(
    recorded: str, conn: psycopg.Connection, thread_worker
) -> None:
    """With keep_done_seconds=0 finished rows are deleted at their acknowledgement; a step that
    others wait for is kept (done) so that its dependents are settled, the others go."""
    schema = recorded
    # Steps that return nothing: their acknowledgement is the plain one, which deletes.
    flow = worker.chain(worker.step(fm.noop), worker.step(fm.noop), worker.step(fm.add, {"n": 1}))
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    # This module's handlers alone: the process-wide registry may also hold other test modules'
    # tasks that store results, which a worker that keeps nothing refuses to run.
    reg = worker.Registry()
    for d in (fm.noop, fm.add):
        reg.task(d.name, max_attempts=d.max_attempts, retry_backoff=d.retry_backoff)(d.fn)
    with thread_worker(reg, keep_done_seconds=0):
        wait_until(lambda: len(runs_of(conn, schema, ids[flow.steps[-1]])) == 1, timeout=30)
        wait_until(lambda: unfinished(conn, schema) == 0, timeout=30)
    assert [r[2] for r in runs_of(conn, schema, ids[flow.steps[-1]])] == [[None]]
    assert row(conn, schema, ids[flow.steps[0]])[0] == "done"
    assert row(conn, schema, ids[flow.steps[1]])[0] == "done"
    assert row(conn, schema, ids[flow.steps[2]]) is None  # deleted at its acknowledgement


def test_retention_takes_a_steps_edges_and_the_workflow_left_without_steps(
    recorded: str, conn: psycopg.Connection, thread_worker
) -> None:
    schema = recorded
    old = worker.enqueue_workflow(
        conn,
        worker.group([worker.step(fm.add), worker.step(fm.add)], then=worker.step(fm.collect)),
        schema=schema,
    )
    young = worker.enqueue_workflow(
        conn, worker.chain(worker.step(fm.add), worker.step(fm.add)), schema=schema
    )
    with thread_worker(worker.registry):
        wait_until(lambda: unfinished(conn, schema) == 0, timeout=30)
    # The first workflow finished two hours ago; of the second, only its first step did.
    conn.execute(
        f"UPDATE {schema}.tasks SET finished_at = now() - interval '2 hours'"
        " WHERE workflow_id = %s OR id = %s",
        (old.id, min(young.ids.values())),
    )
    # A finished step whose dependents were not settled yet (as a rescue leaves one) stays.
    held = worker.enqueue_workflow(
        conn, worker.chain(worker.step(fm.add), worker.step(fm.add)), schema=schema
    )
    first = min(held.ids.values())
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'done', finished_at = now() - interval '2 hours'"
        " WHERE id = %s",
        (first,),
    )

    def edges(wf: int) -> int:
        return conn.execute(
            f"SELECT count(*) FROM {schema}.task_deps AS d JOIN {schema}.tasks AS t"
            " ON t.id = d.task_id WHERE t.workflow_id = %s",
            (wf,),
        ).fetchone()[0]

    all_edges = conn.execute(f"SELECT count(*) FROM {schema}.task_deps").fetchone()[0]
    assert all_edges == 2 + 1 + 1
    gone = worker_store.purge(
        conn, schema, done_seconds=3600, failed_seconds=3600, cron_keep_seconds=0
    )
    assert gone == 3 + 1
    left = conn.execute(f"SELECT id, workflow_id FROM {schema}.tasks ORDER BY id").fetchall()
    assert [r[0] for r in left] == sorted([max(young.ids.values()), *held.ids.values()])
    # The old workflow's edges and row went; the young one keeps the edge its last step needs.
    assert conn.execute(f"SELECT count(*) FROM {schema}.task_deps").fetchone()[0] == 2
    assert edges(young.id) == 1 and edges(held.id) == 1
    flows = {r[0] for r in conn.execute(f"SELECT id FROM {schema}.workflows")}
    assert flows == {young.id, held.id}
    assert row(conn, schema, first)[0] == "done"  # kept until the sweep settles it


def test_enqueue_workflow_is_transactional_with_the_callers_writes(
    recorded: str, conn: psycopg.Connection, pg_dsn: str
) -> None:
    schema = recorded
    with psycopg.connect(pg_dsn) as producer:
        worker.enqueue_workflow(
            producer, worker.chain(worker.step(fm.add), worker.step(fm.add)), schema=schema
        )
        producer.rollback()
    assert states(conn, schema) == {}
    assert conn.execute(f"SELECT count(*) FROM {schema}.task_deps").fetchone() == (0,)


def test_cancelling_a_workflow_cancels_its_waiting_steps_and_stops_its_running_one(
    recorded: str, conn: psycopg.Connection, thread_worker
) -> None:
    schema = recorded
    flow = worker.chain(worker.step(fm.sleep, {"s": 30}), worker.step(fm.add), worker.step(fm.add))
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    with thread_worker(worker.registry):
        wait_until(lambda: runs_of(conn, schema, ids[flow.steps[0]]), timeout=20)
        n = conn.execute(f"SELECT {schema}.cancel_workflow(%s)", (ids.id,)).fetchone()[0]
        assert n == 3
        assert [row(conn, schema, ids[s])[0] for s in flow.steps[1:]] == ["cancelled"] * 2
        wait_until(lambda: unfinished(conn, schema) == 0, timeout=40)
    assert row(conn, schema, ids[flow.steps[0]])[0] == "cancelled"


def test_a_bulk_cancel_of_a_step_cancels_its_dependents_at_once_and_a_bulk_retry_resumes_them(
    recorded: str, pg_dsn: str, conn: psycopg.Connection
) -> None:
    """`worker cancel --ids` of a queued step (a bulk action, no worker running): the join that
    waits for it ends cancelled in the same command, naming it, and the step that runs on
    failure is released; `worker retry --ids --state cancelled` of the step makes both wait for
    it again."""
    schema = recorded
    flow = worker.Workflow("bulk")
    a, b = flow.add(fm.add, {"n": 1}), flow.add(fm.add, {"n": 2})
    join = flow.add(fm.collect, depends_on=[a, b])
    anyway = flow.add(fm.collect, depends_on=[worker.after(a, run_on_failure=True)])
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    out = run_cli("cancel", "--ids", str(ids[a]), "--yes", "--dsn", pg_dsn, "--schema", schema)
    assert out.returncode == 0, out.stderr
    state, _, _, error = row(conn, schema, ids[join])
    assert (state, error) == (
        "cancelled",
        f"DependencyFailed: step {ids[a]} (wf.add) ended cancelled",
    )
    assert row(conn, schema, ids[anyway])[:3] == ("queued", None, [None])
    out = run_cli(
        *("retry", "--ids", str(ids[a]), "--state", "cancelled", "--yes"),
        *("--dsn", pg_dsn, "--schema", schema),
    )
    assert out.returncode == 0, out.stderr
    assert row(conn, schema, ids[a])[0] == "queued"
    assert row(conn, schema, ids[join])[0] == "waiting"


# -- real processes, real signals -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_a_join_whose_inputs_finish_at_the_same_instant_runs_exactly_once(
    recorded: str, conn: psycopg.Connection, pg_dsn: str, processes: int
) -> None:
    """Inputs that all return at one wall-clock instant on every process, round after round: each
    join runs once, with every input in order."""
    schema = recorded
    joins = []
    with pool(
        pg_dsn,
        schema,
        "--processes",
        str(processes),
        "--concurrency",
        "8",
        "--poll-interval",
        "0.2",
    ) as proc:
        wait_until(lambda: len(live_workers(conn, schema)) >= processes, timeout=60)
        for _round in range(5):
            at = time.time() + 1.5
            n = 8 * processes
            flow = worker.group(
                [worker.step(fm.at, {"at": at, "n": i}) for i in range(n)],
                then=worker.step(fm.collect),
            )
            joins.append((worker.enqueue_workflow(conn, flow, schema=schema)[flow.steps[-1]], n))
            wait_until(lambda: unfinished(conn, schema) == 0, timeout=60)
        assert proc.poll() is None
    pids = set()
    for join, n in joins:
        runs = runs_of(conn, schema, join)
        assert len(runs) == 1, runs
        assert runs[0][2] == list(range(n))
        pids.update(
            r[0]
            for r in conn.execute(f"SELECT pid FROM {schema}.runs WHERE task = 'wf.at'").fetchall()
        )
    assert len(pids) == processes  # the inputs were finished by every process
    assert overlapping_runs(conn, schema) == []


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_sigkill_in_the_middle_of_a_fan_in_loses_no_join(
    recorded: str, conn: psycopg.Connection, pg_dsn: str, processes: int
) -> None:
    """A child process is SIGKILLed while it runs inputs of a fan-in: its rows come back and run
    again, never two attempts at once, and the join runs once with every input."""
    schema = recorded
    n = 200
    flow = worker.group(
        [worker.step(fm.sleep, {"s": 0.2, "n": i}) for i in range(n)], then=worker.step(fm.collect)
    )
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    join = ids[flow.steps[-1]]
    with pool(
        pg_dsn, schema, "--processes", str(processes), "--concurrency", "8", "--lease", "2"
    ) as proc:
        wait_until(lambda: len(child_pids(proc)) == processes, timeout=60)
        wait_until(lambda: states(conn, schema).get("done", 0) >= 40, timeout=60)
        # A child that is running inputs now (the others may be between two claims).
        victim = wait_until(lambda: running_pid(conn, schema, child_pids(proc)), timeout=30)
        os.kill(victim, signal.SIGKILL)
        killed = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        wait_until(lambda: row(conn, schema, join)[0] == "done", timeout=90)
    assert states(conn, schema) == {"done": n + 1}
    runs = runs_of(conn, schema, join)
    assert len(runs) == 1 and runs[0][2] == list(range(n))
    # The victim's runs died with it (no end recorded): they end at the kill, or at their start
    # for one whose start the server recorded after the clock was read (a statement the victim
    # sent just before it died): a run cannot end before it began.
    conn.execute(
        f"UPDATE {schema}.runs SET ended = greatest(started, %s) WHERE pid = %s AND ended IS NULL",
        (killed, victim),
    )
    assert overlapping_runs(conn, schema) == []
    again = conn.execute(
        f"SELECT count(DISTINCT task_id) FROM {schema}.runs WHERE attempt > 1"
    ).fetchone()[0]
    assert again >= 1  # the killed process was running some of them


def running_pid(conn: psycopg.Connection, schema: str, pids: set[int]) -> int | None:
    """One of these processes that holds a task in progress, or None."""
    row = conn.execute(
        f"SELECT w.pid FROM {schema}.tasks AS t JOIN {schema}.workers AS w"
        f" ON w.id = t.worker_id WHERE t.state = 'in_progress' AND w.pid = ANY(%s) LIMIT 1",
        (sorted(pids),),
    ).fetchone()
    return row[0] if row else None


@pytest.mark.slow
def test_a_worker_frozen_past_its_lease_cannot_fire_the_join_twice(
    recorded: str, conn: psycopg.Connection, pg_dsn: str
) -> None:
    """SIGSTOP a process holding the last input of a join past its lease: another process runs
    the input again and fires the join; the frozen one, resumed, finds its row lost."""
    schema = recorded
    flow = worker.Workflow("frozen")
    quick = [flow.add(fm.sleep, {"s": 0.01, "n": i}) for i in range(5)]
    slow = flow.add(fm.sleep, {"s": 4, "n": 99})
    join = flow.add(fm.collect, depends_on=[*quick, slow])
    with (
        pool(pg_dsn, schema, "--processes", "1", "--lease", "2", "--poll-interval", "0.2") as a,
        pool(pg_dsn, schema, "--processes", "1", "--lease", "2", "--poll-interval", "0.2") as b,
    ):
        wait_until(lambda: len(live_workers(conn, schema)) >= 2, timeout=60)
        ids = worker.enqueue_workflow(conn, flow, schema=schema)
        first = wait_until(lambda: runs_of(conn, schema, ids[slow]), timeout=20)
        holder = next(p for p in (a, b) if first[0][1] in child_pids(p) | {p.pid})
        frozen = [p for p in psutil_tree(holder)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: row(conn, schema, ids[join])[0] == "done", timeout=60)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        time.sleep(5)  # the resumed process finishes its old attempt and tries to acknowledge it
    runs = runs_of(conn, schema, ids[join])
    assert len(runs) == 1 and runs[0][2] == [0, 1, 2, 3, 4, 99]
    assert len(runs_of(conn, schema, ids[slow])) == 2
    assert row(conn, schema, ids[slow])[0] == "done"


def psutil_tree(proc: subprocess.Popen) -> list[int]:
    parent = psutil.Process(proc.pid)
    return [parent.pid, *(k.pid for k in parent.children(recursive=True))]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_a_graceful_stop_in_the_middle_of_a_workflow_leaves_it_resumable(
    recorded: str, conn: psycopg.Connection, pg_dsn: str, processes: int
) -> None:
    schema = recorded
    flow = worker.Workflow("stopped")
    fan = [flow.add(fm.sleep, {"s": 0.3, "n": i}) for i in range(40)]
    join = flow.add(fm.collect, depends_on=fan)
    tail = flow.add(fm.collect, depends_on=[join])
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    stop = ("--processes", str(processes), "--concurrency", "4", "--grace", "0.1")
    with pool(pg_dsn, schema, *stop) as proc:
        wait_until(lambda: states(conn, schema).get("done", 0) >= 8, timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert states(conn, schema).get("in_progress", 0) == 0
    assert row(conn, schema, ids[join])[0] == "waiting"
    with pool(pg_dsn, schema, "--processes", "2", "--concurrency", "4"):
        try:
            wait_until(lambda: row(conn, schema, ids[tail])[0] == "done", timeout=90)
        except AssertionError:
            raise AssertionError(
                conn.execute(
                    f"SELECT id, state, pending_deps, dependents, attempts, last_error"
                    f" FROM {schema}.tasks WHERE state <> 'done' ORDER BY id"
                ).fetchall()
            ) from None
    assert len(runs_of(conn, schema, ids[join])) == 1
    assert overlapping_runs(conn, schema) == []


@pytest.mark.slow
def test_a_workflow_of_100000_steps_enqueues_and_drains(
    recorded: str, conn: psycopg.Connection, pg_dsn: str
) -> None:
    schema = recorded
    n = 100_000
    flow = worker.group(
        [worker.step(fm.noop, {"i": i}) for i in range(n - 1)], then=worker.step(fm.count_inputs)
    )
    began = time.monotonic()
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    enqueued = time.monotonic() - began
    assert states(conn, schema) == {"queued": n - 1, "waiting": 1}
    assert enqueued < 120
    with pool(pg_dsn, schema, "--processes", "2", "--concurrency", "50", "--batch-size", "200"):
        wait_until(
            lambda: row(conn, schema, ids[flow.steps[-1]])[0] == "done", timeout=600, interval=1.0
        )
    assert states(conn, schema) == {"done": n}
    assert len(row(conn, schema, ids[flow.steps[-1]])[2]) == n - 1  # the join got every input
