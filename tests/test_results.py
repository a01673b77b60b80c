"""Results and waiting: a handler's return value stored with its row, and worker.wait / Waiter /
`worker wait` woken by the completing transaction's notification (worker/tasks/results.py,
worker/tasks/wait.py, worker/tasks/waiter.py). Handlers live in tests/results_module.py and run in
real
`worker run` processes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import every_statement, run_cli, spawn_cli, wait_until
from psycopg_pool import ConnectionPool

import worker
from worker import store as tr
from worker.db.sql import parse_named
from worker.engine.batch import Batcher
from worker.engine.job import Job, Outcome
from worker.tasks.registry import Registry

MODULE = "results_module"
# A poll interval no test would sit through: a wait that returns quickly was woken by NOTIFY.
SLOW_POLL = 30.0


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def start_worker(
    pg_dsn: str, schema: str, conn: psycopg.Connection, tmp_path: Path
) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start a real worker process on the test's schema; wait until it has registered."""
    procs: list[subprocess.Popen[str]] = []

    def start(*extra: str) -> subprocess.Popen[str]:
        log = open(tmp_path / f"worker{len(procs)}.log", "w")  # noqa: SIM115
        args = ["run", MODULE, "--processes", "1", "--dsn", pg_dsn, "--schema", schema, *extra]
        proc = spawn_cli(*args, stderr=log)
        procs.append(proc)
        wait_until(
            lambda: (
                proc.poll() is not None
                or conn.execute(f"SELECT count(*) FROM {schema}.workers").fetchone()[0]
            ),
            timeout=30,
        )
        assert proc.poll() is None, (tmp_path / f"worker{len(procs) - 1}.log").read_text()
        return proc

    yield start
    for proc in procs:
        _stop(proc)


def _row(conn: psycopg.Connection, schema: str, task_id: int) -> tuple[Any, ...]:
    row = conn.execute(
        f"SELECT state::text, result, last_error, attempts FROM {schema}.tasks WHERE id = %s",
        (task_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


# -- storing results ---------------------------------------------------------------------------


def test_a_result_round_trips_through_the_row_and_wait(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    payload = {"ключ": ["значение", {"n": 10**18, "f": -0.5}], "emoji": "🙂"}
    task_id = worker.enqueue(conn, "r_echo", payload, schema=schema)
    async_id = worker.enqueue(conn, "r_async", {"n": 7}, schema=schema)
    start_worker()
    result = worker.wait(pg_dsn, task_id, timeout=30, schema=schema)
    assert result["payload"] == payload
    assert result["text"] == "naïve café, 東京, 🙂, \u202e"
    assert result["nested"] == {"list": [1, 2.5, None, True, {"deep": ["x"]}]}
    state, stored, _, _ = _row(conn, schema, task_id)
    assert state == "done" and stored == result  # what a user reads with SQL, too
    assert worker.wait(conn, async_id, timeout=30, schema=schema) == ["async", 7]


def test_tasks_that_do_not_store_results_leave_the_column_null_and_notify_nobody(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{schema}.done"')
        ids = [worker.enqueue(conn, "r_plain", {"i": i}, schema=schema) for i in range(20)]
        start_worker()
        wait_until(lambda: all(_row(conn, schema, i)[0] == "done" for i in ids), timeout=30)
        heard = list(listener.notifies(timeout=0.5))
    assert heard == []
    rows = conn.execute(f"SELECT count(*) FROM {schema}.tasks WHERE result IS NOT NULL").fetchone()
    assert rows[0] == 0
    # A wait on such a task still works (by polling), and gives None.
    assert worker.wait(pg_dsn, ids[0], timeout=5, schema=schema, poll_interval=0.1) is None


def test_a_result_over_the_limit_fails_the_task_at_once_with_a_clear_message(
    schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    small = worker.enqueue(conn, "r_sized", {"size": 900}, schema=schema)
    big = worker.enqueue(conn, "r_sized", {"size": 1200}, schema=schema)
    start_worker("--max-result-size", "1000")
    wait_until(lambda: _row(conn, schema, big)[0] == "failed", timeout=30)
    _, result, error, attempts = _row(conn, schema, big)
    assert result is None
    assert attempts == 1  # not retried: the same handler would return the same value
    assert error.startswith(
        "ResultTooLarge: the handler's return value is 1,202 bytes of JSON, over the limit of 1,000"
    )
    wait_until(lambda: _row(conn, schema, small)[0] == "done", timeout=30)
    assert _row(conn, schema, small)[1] == "x" * 900


def test_values_jsonb_cannot_hold_fail_the_task_alone(
    schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    bad = {
        kind: worker.enqueue(conn, "r_unstorable", {"kind": kind}, schema=schema)
        for kind in ("set", "nan", "nul", "surrogate")
    }
    good = worker.enqueue(conn, "r_echo", {}, schema=schema)  # in the same batches
    start_worker()
    for task_id in bad.values():
        wait_until(lambda t=task_id: _row(conn, schema, t)[0] == "failed", timeout=30)
    for kind, task_id in bad.items():
        _, result, error, attempts = _row(conn, schema, task_id)
        assert result is None and attempts == 1, kind
        assert error.startswith("ResultNotSerializable: the handler's return value"), error
    assert "NUL" in _row(conn, schema, bad["nul"])[2]
    wait_until(lambda: _row(conn, schema, good)[0] == "done", timeout=30)


def test_keys_that_collide_as_json_text_fail_the_task_instead_of_losing_a_value(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    """{1: "a", "1": "b"} stored as JSON kept one of the two, silently. Now the task fails at
    once (the same handler would return the same value), saying which keys and where; keys that
    do not collide are written as text, as json.dumps writes them."""
    kinds = ("int and str", "none and null", "true and str", "distinct")
    ids = {k: worker.enqueue(conn, "r_keys", {"kind": k}, schema=schema) for k in kinds}
    start_worker()
    for task_id in ids.values():
        wait_until(lambda t=task_id: _row(conn, schema, t)[0] in ("done", "failed"), timeout=30)
    expected = {
        "int and str": "1 and '1' (in result['counts'])",
        "none and null": "None and 'null' (in result[0])",
        "true and str": "True and 'true' (in result)",
    }
    for kind, where in expected.items():
        state, result, error, attempts = _row(conn, schema, ids[kind])
        assert (state, result, attempts) == ("failed", None, 1), kind
        assert error.startswith(
            "ResultNotSerializable: the handler's return value has two keys that JSON writes as "
            f"the same text, {where}: an object stored as JSON would keep only one of them"
        ), error
    state, result, _, _ = _row(conn, schema, ids["distinct"])
    assert state == "done"
    assert result == {"1": "a", "2.5": "b", "null": "c", "false": "d", "x": {"7": "e"}}
    with pytest.raises(worker.TaskFailed, match="two keys that JSON writes as the same text"):
        worker.wait(pg_dsn, ids["int and str"], timeout=5, schema=schema)


def test_a_transactional_handler_stores_its_result_in_its_own_transaction(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    ok = worker.enqueue(conn, "r_tx", {}, schema=schema)
    big = worker.enqueue(conn, "r_tx", {"size": 2000}, schema=schema)
    start_worker("--max-result-size", "1000")
    assert worker.wait(pg_dsn, ok, timeout=30, schema=schema, poll_interval=SLOW_POLL) == {
        "tx": ok,
        "size": "",
    }
    with pytest.raises(worker.TaskFailed, match="ResultTooLarge"):
        worker.wait(pg_dsn, big, timeout=30, schema=schema, poll_interval=SLOW_POLL)


def test_storing_results_with_keep_done_0_is_refused_at_startup(schema: str) -> None:
    out = run_cli("run", MODULE, "--processes", "2", "--keep-done", "0", "--schema", schema)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "store results need their done rows kept" in lines[0]
    assert "r_echo" in lines[0]


# -- the acknowledgement path --------------------------------------------------------------------

# The statement that marks tasks done when they store nothing, as issue 11 left it plus the cancel
# request (schema/0010: a CASE on cancel_requested_at; 1.40 against 1.36 ms per 50 rows, in the
# server) and the permits it frees (schema/0017: a CTE over the rows it acknowledged; 1.97 against
# 1.92 and 2.17 against 2.11 ms per 50 rows with the round trip, alternating, two runs), which
# schema/0020 took out again (a permit is free once its attempt ends: 100 rows claimed under a
# concurrency limit were acknowledged in 2.0 ms of server time instead of 11.8, auto_explain,
# same table): a change to it must be deliberate (update this hash in the same commit, with a
# measurement). Its whole-line comments and its lines' indentation are not part of it
# (parse_named drops them; the hash changed once for that alone, the statement did not). It
# changed again when it became prepared, reading the batch by id = ANY(ids) instead of joining
# unnest(ids, attempts): one row acknowledged in 0.29 ms of client time against 0.37-0.53, 100
# rows in 0.92-1.38 ms against 1.18-1.69 (benchmarks, 2026-11-27 13:00).
COMPLETE_SHA256 = "13df1863b2e70cf461996d4fc0ddeac7fc44133e33bd7b2d9f920d9b76c0c307"


class Traced(psycopg.Connection):  # type: ignore[type-arg]
    """A real connection that remembers the statements run on it."""

    seen: list[str]

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        text = query if isinstance(query, str) else query.as_string(self)
        self.__dict__.setdefault("seen", []).append(text)
        return super().execute(query, params, **kwargs)


def _jobs(conn: psycopg.Connection, schema: str, n: int, results: list[str | None]) -> list[Job]:
    q = every_statement(schema)
    for i in range(n):
        worker.enqueue(conn, "t", {"i": i}, queue="q", schema=schema)
    rows = tr.claim(conn, q.schema, queues=["q"], limit=n, worker_id=WID, lease_seconds=30)
    reg = Registry()
    definition = reg.task("t")(lambda p: None)
    return [
        Job(i, c, definition, 0.0, None, outcome=Outcome(i, ok=True, result=results[i]))
        for i, c in enumerate(rows)
    ]


WID = "00000000-0000-0000-0000-000000000001"


def test_tasks_without_results_are_acknowledged_by_complete_alone(pg_dsn: str, schema: str) -> None:
    text = parse_named((Path(worker.__file__).parent / "store" / "acks.sql").read_text())
    assert hashlib.sha256(text["complete"].encode()).hexdigest() == COMPLETE_SHA256
    q = every_statement(schema)
    batcher = Batcher(
        q,
        WID,
        queues=["q"],
        batch_size=100,
        lease_seconds=30,
        delete_done=False,
        max_attempts={},
        poll_interval=1,
        channel=f"{schema}.tasks",
        done_channel=f"{schema}.done",
        stores_result=lambda d: True,
    )
    with Traced.connect(pg_dsn, autocommit=True) as conn:
        jobs = _jobs(conn, schema, 100, [None] * 100)
        conn.seen = []
        with conn.transaction():
            kept, states = batcher.acknowledge(conn, jobs)
        assert len(kept) == 100 and states == {}
        assert conn.seen == [q["complete"].as_string(conn)]  # one statement, the same one

        mixed = _jobs(conn, schema, 4, [None, '{"a": 1}', None, "[2]"])
        conn.seen = []
        with conn.transaction():
            kept, _ = batcher.acknowledge(conn, mixed)
        assert kept == {j.id: "done" for j in mixed}
        assert conn.seen == [
            q["complete"].as_string(conn),
            q["complete_with_result"].as_string(conn),
            q["notify_done"].as_string(conn),
        ]
        got = dict(conn.execute(f"SELECT id, result FROM {schema}.tasks WHERE state = 'done'"))
        assert [got[j.id] for j in mixed] == [None, {"a": 1}, None, [2]]

        # Results carried for a workflow's dependents by a task that stores none: stored, not
        # announced (a notification would serialize the commits of every acknowledging worker).
        batcher.stores_result = lambda d: False
        carried = _jobs(conn, schema, 2, ["null", "[3]"])
        conn.seen = []
        with conn.transaction():
            kept, _ = batcher.acknowledge(conn, carried)
        assert kept == {j.id: "done" for j in carried}
        assert conn.seen == [q["complete_with_result"].as_string(conn)]


# -- waiting ------------------------------------------------------------------------------------


def test_wait_is_woken_by_the_completing_transaction_not_by_polling(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    start_worker("--poll-interval", "0.05")
    for sleep in (0.3, 1.0):
        task_id = worker.enqueue(conn, "r_echo", {"sleep": sleep}, schema=schema)
        started = time.monotonic()
        result = worker.wait(pg_dsn, task_id, timeout=10, schema=schema, poll_interval=SLOW_POLL)
        returned = time.time()
        assert time.monotonic() - started >= sleep
        # The handler returned; the acknowledgement (batched for up to 20 ms) committed and
        # notified; the wait read the row: all within ~100 ms, with a 30 s poll interval.
        assert returned - result["returned_at"] < 0.15, returned - result["returned_at"]


def test_the_async_twin_is_woken_too(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    start_worker("--poll-interval", "0.05")
    first = worker.enqueue(conn, "r_echo", {"sleep": 0.5}, schema=schema)
    second = worker.enqueue(conn, "r_echo", {"sleep": 0.5, "n": 2}, schema=schema)

    async def main() -> list[Any]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as aconn:
            return await asyncio.gather(
                worker.wait_async(aconn, first, timeout=10, schema=schema, poll_interval=SLOW_POLL),
                worker.wait_async(
                    pg_dsn, second, timeout=10, schema=schema, poll_interval=SLOW_POLL
                ),
            )

    started = time.monotonic()
    a, b = asyncio.run(main())
    assert time.monotonic() - started < 3
    assert a["payload"] == {"sleep": 0.5} and b["payload"]["n"] == 2
    assert time.time() - max(a["returned_at"], b["returned_at"]) < 0.5


def test_wait_raises_for_failed_cancelled_missing_and_late_tasks(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    later = worker.enqueue(conn, "r_echo", {}, delay=3600, schema=schema)
    cancelled = worker.enqueue(conn, "r_echo", {}, delay=3600, schema=schema)
    assert run_cli("cancel", str(cancelled), "--dsn", pg_dsn, "--schema", schema).returncode == 0
    failing = worker.enqueue(conn, "r_fail", {}, schema=schema)
    start_worker()
    with pytest.raises(worker.TaskFailed) as failed:
        worker.wait(pg_dsn, failing, timeout=30, schema=schema, poll_interval=SLOW_POLL)
    assert str(failed.value) == f"task {failing} failed: ValueError: boom: ünïcode"
    assert failed.value.error.startswith("ValueError: boom: ünïcode\n")  # with its traceback
    with pytest.raises(worker.TaskCancelled, match=f"task {cancelled} was cancelled"):
        worker.wait(pg_dsn, cancelled, timeout=5, schema=schema)
    with pytest.raises(worker.TaskNotFound):
        worker.wait(pg_dsn, 10**12, timeout=5, schema=schema)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"task {later} did not finish within 0.5s"):
        worker.wait(conn, later, timeout=0.5, schema=schema)
    assert 0.5 <= time.monotonic() - started < 1.5
    with pytest.raises(worker.WaitTimeout):
        asyncio.run(worker.wait_async(pg_dsn, later, timeout=0.2, schema=schema))
    # A pool's connection works; a connection inside a transaction is refused.
    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True) as pool:
        with pytest.raises(worker.TaskCancelled):
            worker.wait(pool, cancelled, timeout=5, schema=schema)
        with pool.connection() as pooled:
            assert pooled.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with psycopg.connect(pg_dsn) as tx_conn:
        tx_conn.execute("SELECT 1")
        with pytest.raises(ValueError, match="outside any transaction"):
            worker.wait(tx_conn, later, timeout=1, schema=schema)


def test_two_thousand_concurrent_waits_share_one_connection(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    n = 2000
    worker.enqueue_many(conn, "r_async", ({"n": i} for i in range(n)), schema=schema)
    ids = [r[0] for r in conn.execute(f"SELECT id FROM {schema}.tasks ORDER BY id")]
    ids_by_n = {json.dumps(["async", i]): task_id for i, task_id in enumerate(ids)}
    app = f"waiter-{schema}"

    def connections() -> int:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
        ).fetchone()
        return int(row[0])

    async def main(waiter: worker.Waiter) -> list[Any]:
        waits = [asyncio.ensure_future(waiter.wait_async(i, timeout=60)) for i in ids]
        await asyncio.sleep(0.5)  # every wait registered, none can finish: no worker yet
        assert not any(w.done() for w in waits)
        assert connections() == 1
        start_worker("--poll-interval", "0.05")
        return await asyncio.gather(*waits)

    with worker.Waiter(pg_dsn, schema=schema, poll_interval=SLOW_POLL, application_name=app) as w:
        results = asyncio.run(main(w))
        assert connections() == 1
        # The same waiter from threads: wait_many over all of them at once.
        assert w.wait_many(ids, timeout=10) == results
    assert [ids_by_n[json.dumps(r)] for r in results] == ids
    wait_until(lambda: connections() == 0, timeout=5)


def test_a_waiter_reports_each_outcome_and_times_out(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    ok = worker.enqueue(conn, "r_async", {"n": 1}, schema=schema)
    failing = worker.enqueue(conn, "r_fail", {}, schema=schema)
    later = worker.enqueue(conn, "r_echo", {}, delay=3600, schema=schema)
    with worker.Waiter(pg_dsn, schema=schema, poll_interval=SLOW_POLL) as w:
        start_worker()
        out = w.wait_many([ok, failing, later], timeout=5, return_exceptions=True)
        assert out[0] == ["async", 1]
        assert isinstance(out[1], worker.TaskFailed) and "boom" in str(out[1])
        assert isinstance(out[2], worker.WaitTimeout)
        with pytest.raises(worker.TaskFailed):
            w.wait_many([ok, failing], timeout=5)
        with pytest.raises(TimeoutError):
            w.wait(later, timeout=0.2)


# -- the CLI ------------------------------------------------------------------------------------


def test_worker_wait_exit_codes(
    pg_dsn: str, schema: str, conn: psycopg.Connection, start_worker: Any
) -> None:
    done = worker.enqueue(conn, "r_async", {"n": "ü"}, schema=schema)
    failing = worker.enqueue(conn, "r_fail", {}, schema=schema)
    later = worker.enqueue(conn, "r_echo", {}, delay=3600, schema=schema)
    start_worker()
    common = ["--dsn", pg_dsn, "--schema", schema]

    out = run_cli("wait", str(done), "--timeout", "30", *common)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["async", "ü"]
    out = run_cli("wait", str(done), "--json", *common)
    assert json.loads(out.stdout) == {"id": done, "state": "done", "result": ["async", "ü"]}

    out = run_cli("wait", str(failing), "--timeout", "30", *common)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"worker: error: task {failing} failed: ValueError: boom: ünïcode"
    ]
    out = run_cli("wait", str(failing), "--json", *common)
    assert out.returncode == 1 and json.loads(out.stdout)["state"] == "failed"

    out = run_cli("wait", str(later), "--timeout", "0.3", *common)
    assert out.returncode == 3
    assert f"task {later} did not finish within 0.3s" in out.stderr

    assert run_cli("cancel", str(later), *common).returncode == 0
    out = run_cli("wait", str(later), *common)
    assert out.returncode == 1 and "was cancelled" in out.stderr

    for bad in (["wait", "abc"], ["wait", "1", "--timeout", "-1"], ["wait"]):
        out = run_cli(*bad, *common)
        assert out.returncode == 2, bad
        assert len(out.stderr.strip().splitlines()) == 1
