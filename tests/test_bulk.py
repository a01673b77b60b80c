"""Bulk retry, cancel and delete by filter (issue 12): from the CLI, from Python and from psql.

A dry run changes nothing; an action works in batches of bounded size, walks every row it should
exactly once, skips (and reports) what it must not touch, and is recorded with who ran it. The
--error filter is an ILIKE pattern over the whole error (see worker/ops/bulk.py): %, _ and \\ are
what the user typed them as, and quotes or semicolons are data.
"""

from __future__ import annotations

import getpass
import json
import signal
import socket
import subprocess
import time
from typing import Any

import psycopg
import pytest
from conftest import every_statement, run_cli, spawn_cli, states, wait_until

import worker
from worker import store as tr
from worker.ops import audit as _audit
from worker.ops import bulk as _bulk
from worker.ops.bulk import Filter, like_escape


def _common(pg_dsn: str, schema: str) -> list[str]:
    return ["--dsn", pg_dsn, "--schema", schema]


def _snapshot(conn: psycopg.Connection, schema: str) -> list[tuple[str, ...]]:
    """Every row of the task table and of the record of actions, whole, as text."""
    tasks = conn.execute(f"SELECT t::text FROM {schema}.tasks AS t ORDER BY id").fetchall()
    actions = conn.execute(f"SELECT a::text FROM {schema}.actions AS a ORDER BY id").fetchall()
    return [*tasks, ("actions",), *actions]


def _failed(
    conn: psycopg.Connection,
    schema: str,
    n: int,
    *,
    queue: str = "mail",
    task: str = "send",
    error: str = "boom",
    age: str = "1 hour",
    keys: list[str | None] | None = None,
) -> None:
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, max_attempts, finished_at,"
        " last_error, dedupe_key)"
        " SELECT %s, %s, 'failed', 5, 5, now() - %s::interval - g * interval '1 ms', %s,"
        " (%s::text[])[g]"
        " FROM generate_series(1, %s) AS g",
        (task, queue, age, error, keys or [], n),
    )


def _mixed(conn: psycopg.Connection, schema: str) -> None:
    """A little of everything, in three queues."""
    for queue in ("mail", "reports", "images"):
        _failed(conn, schema, 4, queue=queue, error=f"TimeoutError: {queue} timed out")
        _failed(conn, schema, 3, queue=queue, error="ValueError: bad record", age="3 days")
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, priority, run_at)"
            " SELECT 'send', %s, g %% 3, now() + (g %% 2) * interval '1 hour'"
            " FROM generate_series(1, 6) AS g",
            (queue,),
        )
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, state, attempts, finished_at)"
            f" SELECT 'send', %s, s::{schema}.task_state, 1, now() - g * interval '1 day'"
            " FROM generate_series(1, 3) AS g, unnest(ARRAY['done', 'cancelled']) AS s",
            (queue,),
        )


# -- the two lists of states agree -----------------------------------------------------------------


def test_python_and_the_schema_agree_on_the_states_of_each_action(
    conn: psycopg.Connection, schema: str
) -> None:
    q = every_statement(schema)
    for action, (allowed, default) in _bulk.ACTIONS.items():
        got = conn.execute(q["bulk_states"], {"action": action, "states": None}).fetchone()
        assert got == (list(default),)
        got = conn.execute(q["bulk_states"], {"action": action, "states": list(allowed)})
        assert got.fetchone() == (list(allowed),)
        assert _bulk.states_for(action, Filter(states=allowed)) == list(allowed)
        for other in {*_bulk.WAITING, "done", "failed", "cancelled", "in_progress"} - set(allowed):
            with pytest.raises(psycopg.errors.InvalidParameterValue):
                conn.execute(q["bulk_states"], {"action": action, "states": [other]})
            with pytest.raises(_bulk.BulkError):
                _bulk.states_for(action, Filter(states=(other,)))


def test_done_and_cancelled_are_walked_together(conn: psycopg.Connection, schema: str) -> None:
    """One index holds both: a walk of each would read the other's entries too."""
    for names in (
        ["done", "failed", "cancelled", "scheduled", "queued"],
        ["cancelled", "queued"],
        ["failed"],
        ["done"],
    ):
        rows = conn.execute(f"SELECT w FROM {schema}.bulk_walks(%s) AS w", (names,)).fetchall()
        assert [w for (w,) in rows] == _bulk.walks(names)
    assert _bulk.walks(["done", "failed", "cancelled"]) == [["done", "cancelled"], ["failed"]]


# -- dry run ---------------------------------------------------------------------------------------


def test_a_dry_run_counts_shows_examples_and_changes_nothing(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _mixed(conn, schema)
    before = _snapshot(conn, schema)
    common = _common(pg_dsn, schema)
    r = run_cli("retry", "--queue", "mail", "--error", "Timeout%", *common)
    assert r.returncode == 0, r.stderr
    assert "would requeue 4 task(s) matching state failed, queue 'mail'" in r.stdout
    assert r.stdout.count("TimeoutError: mail timed out") == 4  # the examples
    assert "nothing changed: add --yes to requeue them" in r.stdout
    for args in (
        ["cancel", "--queue", "reports"],
        ["delete", "--state", "done,cancelled,queued,scheduled,failed"],
        ["delete", "--older-than", "2d"],
        ["retry", "--state", "failed,cancelled", "--older-than", "1h30m"],
    ):
        r = run_cli(*args, "--json", *common)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["dry_run"] is True and out["changed"] == 0 and out["action_id"] is None
    cancel = json.loads(run_cli("cancel", "--queue", "reports", "--json", *common).stdout)
    assert cancel["matched"] == 6
    out = json.loads(
        run_cli(
            "delete", "--state", "done,cancelled,queued,scheduled,failed", "--json", *common
        ).stdout
    )
    assert out["matched"] == 3 * (7 + 6 + 6)
    old = json.loads(run_cli("delete", "--older-than", "2d", "--json", *common).stdout)
    # Finished at least two days ago: the 3-day failures, and done/cancelled of days 2 and 3.
    assert old["matched"] == 3 * (3 + 2 * 2)
    assert _snapshot(conn, schema) == before


# -- batches ---------------------------------------------------------------------------------------


def test_a_bulk_retry_of_20000_rows_runs_in_batches_and_requeues_them_all(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _failed(conn, schema, 20_000, error="TimeoutError: upstream")
    _failed(conn, schema, 50, error="ValueError: kept")  # not matched by the pattern
    r = run_cli(
        "retry", "--error", "timeout%", "--yes", "--batch-size", "5000", "--json",
        *_common(pg_dsn, schema),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["matched"] == out["changed"] == 20_000
    assert out["batches"] >= 4
    rows = conn.execute(
        f"SELECT state::text, attempts, finished_at IS NULL, count(*) FROM {schema}.tasks"
        " GROUP BY 1, 2, 3 ORDER BY 1"
    ).fetchall()
    assert rows == [("failed", 5, False, 50), ("queued", 0, True, 20_000)]
    # Each batch was a transaction of its own, of at most 5,000 rows: the rows one transaction
    # wrote share its id (xmin).
    per_xact = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE state = 'queued' GROUP BY xmin::text"
    ).fetchall()
    assert len(per_xact) >= 4 and max(n for (n,) in per_xact) <= 5000


@pytest.mark.parametrize("batch", [1, 3, 7, 5000])
def test_every_walk_sees_every_row_once_whatever_the_batch(
    conn: psycopg.Connection, schema: str, batch: int
) -> None:
    """Keyset walks over each state's index, across queues and priorities, rows sharing a
    finished_at or a run_at, and rows without a finished_at (set by hand)."""
    _mixed(conn, schema)
    conn.execute(f"UPDATE {schema}.tasks SET finished_at = NULL WHERE id % 5 = 0")
    conn.execute(  # ties: many rows of one instant
        f"INSERT INTO {schema}.tasks (task, queue, state, finished_at, run_at)"
        f" SELECT 'send', 'mail', s::{schema}.task_state, '2026-01-01', '2026-01-01'"
        " FROM generate_series(1, 9), unnest(ARRAY['done', 'failed', 'cancelled']) AS s"
    )
    total = states(conn, schema)
    for action, flt in [
        ("cancel", Filter(task="send")),
        ("cancel", Filter(queue="mail")),
        ("retry", Filter(states=("failed", "cancelled"))),
        ("delete", Filter(states=("done", "failed", "cancelled", "scheduled", "queued"))),
    ]:
        seen = _bulk.preview(conn, schema, action, flt, batch=batch)
        expected = conn.execute(
            f"SELECT count(*) FROM {schema}.tasks WHERE state::text = ANY(%s)"
            " AND (%s::text IS NULL OR queue = %s)",
            (seen.states, flt.queue, flt.queue),
        ).fetchone()
        assert seen.matched == expected[0], (action, flt)
    out = _bulk.apply(
        conn, schema, "delete", Filter(states=("done", "failed", "cancelled", "scheduled",
        "queued")), actor="t", batch=batch,
    )  # fmt: skip
    assert out.changed == sum(total.values())
    assert states(conn, schema) == {}


def test_a_task_retried_by_the_action_that_fails_again_is_not_retried_twice(
    conn: psycopg.Connection, schema: str
) -> None:
    _failed(conn, schema, 10)
    flt = {"queue": "mail"}
    first = tr.bulk_step(conn, schema, action="retry", states=["failed"], filter=flt,
                         cursor=None, batch=4, dry_run=False)  # fmt: skip
    assert first.changed == 4 and first.cursor is not None
    # One of them runs and fails again at once, after the action started.
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'failed', finished_at = now() + interval '1 s'"
        f" WHERE id = (SELECT min(id) FROM {schema}.tasks WHERE state = 'queued')"
    )
    cursor, changed = first.cursor, first.changed
    while cursor is not None:
        step = tr.bulk_step(conn, schema, action="retry", states=["failed"], filter=flt,
                            cursor=cursor, batch=4, dry_run=False)  # fmt: skip
        cursor, changed = step.cursor, changed + step.changed
    assert changed == 10
    assert states(conn, schema) == {"queued": 9, "failed": 1}


# -- what a bulk action leaves alone ---------------------------------------------------------------


def test_bulk_retry_skips_and_reports_tasks_whose_dedupe_key_is_taken(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _failed(conn, schema, 6, keys=["k1", "k2", "k3", None, "k4", "k4"])
    conn.execute(  # k1 is queued again, k2 is scheduled
        f"INSERT INTO {schema}.tasks (task, queue, dedupe_key, run_at) VALUES"
        " ('send', 'other', 'k1', now()), ('send', 'other', 'k2', now() + interval '1 hour')"
    )
    common = _common(pg_dsn, schema)
    dry = run_cli("retry", "--queue", "mail", *common)
    assert "would requeue 3 task(s)" in dry.stdout, dry.stdout
    assert "skipped 3 whose dedupe key a scheduled, queued or running task holds" in dry.stdout
    r = run_cli("retry", "--queue", "mail", "--yes", "--batch-size", "2", "--json", *common)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["changed"], out["skipped_dedupe"]) == (3, 3)
    kept = conn.execute(
        f"SELECT id, dedupe_key FROM {schema}.tasks WHERE queue = 'mail' AND state = 'failed'"
        " ORDER BY id"
    ).fetchall()
    assert [k for _, k in kept] == ["k1", "k2", "k4"]
    assert sorted(out["skipped_dedupe_ids"]) == [i for i, _ in kept]
    text = run_cli("retry", "--queue", "mail", "--yes", *common)
    assert "requeued 0 task(s)" in text.stdout
    assert "skipped 3 whose dedupe key" in text.stdout and "they stay as they are" in text.stdout


def test_running_tasks_of_a_real_worker_are_never_touched(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A worker process runs slow tasks; bulk cancel and delete over their queue (every state
    they may name) leave the running rows alone, report them, and the tasks complete."""
    conn.execute(
        f"CREATE TABLE {schema}.executions (task_id bigint, attempt int, pid int,"
        " started timestamptz, finished timestamptz)"
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, payload)"
        " SELECT 'slow', 'slowq', '{\"sleep\": 8}' FROM generate_series(1, 3)"
    )  # long enough for two commands to start and act on a busy machine
    env = {"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema}
    common = _common(pg_dsn, schema)
    proc = spawn_cli(
        "run", "tasks_module", "--processes", "1", "--concurrency", "3", "--queues", "slowq",
        *common, env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: states(conn, schema).get("in_progress") == 3, timeout=60)
        running = conn.execute(
            f"SELECT id, attempts, worker_id, lease_expires_at IS NOT NULL FROM {schema}.tasks"
            " ORDER BY id"
        ).fetchall()
        # Work that is not running yet, in the same queue: that is what the actions take.
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, run_at) VALUES ('slow', 'slowq',"
            " now() + interval '1 hour'), ('slow', 'slowq', now() + interval '2 hours')"
        )
        r = run_cli("cancel", "--queue", "slowq", "--task", "slow", "--yes", "--json", *common)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert (out["changed"], out["running"]) == (2, 3)
        assert out["running_ids"] == [i for i, *_ in running]
        text = run_cli(
            "delete", "--queue", "slowq", "--state", "done,failed,cancelled,scheduled,queued",
            "--yes", *common,
        )  # fmt: skip
        assert text.returncode == 0, text.stderr
        assert "deleted 2 task(s)" in text.stdout
        assert "left 3 running task(s) alone that match" in text.stdout
        now = conn.execute(
            f"SELECT id, attempts, worker_id, lease_expires_at IS NOT NULL FROM {schema}.tasks"
            " ORDER BY id"
        ).fetchall()
        assert now == running  # same rows, same attempt, same owner, still leased
        assert states(conn, schema) == {"in_progress": 3}
        wait_until(lambda: states(conn, schema) == {"done": 3}, timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    runs = conn.execute(f"SELECT count(*) FROM {schema}.executions").fetchone()
    assert runs == (3,)


# -- filters: the user's text, as the user meant it ------------------------------------------------


HOSTILE = [
    "100% done",
    "100x done",
    "no_such_table",
    "noXsuchXtable",
    "'; DROP TABLE tasks; --",
    "back\\slash",
    "TimeoutError: read timed out",
    "timeout",
    "a timeout later",
]


def _matched(pg_dsn: str, schema: str, *args: str) -> list[str]:
    r = run_cli("retry", "--state", "failed", *args, "--json", "--examples", "50",
                *_common(pg_dsn, schema))  # fmt: skip
    assert r.returncode == 0, r.stderr
    return sorted(e["last_error"] for e in json.loads(r.stdout)["examples"])


def test_the_error_filter_is_a_like_pattern_and_hostile_text_is_data(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    for error in HOSTILE:
        _failed(conn, schema, 1, error=error)
    before = _snapshot(conn, schema)
    assert _matched(pg_dsn, schema, "--error", "%100\\% done%") == ["100% done"]
    assert _matched(pg_dsn, schema, "--error", "%100% done%") == ["100% done", "100x done"]
    assert _matched(pg_dsn, schema, "--error", "no\\_such\\_table") == ["no_such_table"]
    assert _matched(pg_dsn, schema, "--error", "no_such_table") == [
        "noXsuchXtable", "no_such_table",
    ]  # fmt: skip
    assert _matched(pg_dsn, schema, "--error", "%'; DROP TABLE%") == ["'; DROP TABLE tasks; --"]
    assert _matched(pg_dsn, schema, "--error", "%back\\\\slash%") == ["back\\slash"]
    # Case-insensitive, over the whole error: a prefix, the whole text, anywhere.
    assert _matched(pg_dsn, schema, "--error", "Timeout%") == [
        "TimeoutError: read timed out", "timeout",
    ]  # fmt: skip
    assert _matched(pg_dsn, schema, "--error", "TIMEOUT") == ["timeout"]
    assert len(_matched(pg_dsn, schema, "--error", "%timeout%")) == 3
    # A literal text, escaped for the pattern by the Python API.
    for text in ("100% done", "no_such_table", "back\\slash", "'; DROP"):
        flt = Filter(error=f"%{like_escape(text)}%")
        out = _bulk.preview(conn, schema, "retry", flt, examples=50)
        assert [e["last_error"] for e in out.examples] == [e for e in HOSTILE if text in e]
    assert _snapshot(conn, schema) == before  # dry runs all, and the table is still there


def test_names_are_matched_exactly_whatever_they_hold(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    for queue in ("q'%_", "q'x1", "Q'%_", "q\\"):
        _failed(conn, schema, 1, queue=queue, task=queue)
    for name in ("q'%_", "q\\"):
        for flag in ("--queue", "--task"):
            out = json.loads(
                run_cli("delete", flag, name, "--json", *_common(pg_dsn, schema)).stdout
            )
            assert out["matched"] == 1, (flag, name)


def test_age_means_finished_for_finished_tasks_and_created_for_waiting_ones(
    conn: psycopg.Connection, schema: str
) -> None:
    _failed(conn, schema, 2, age="2 hours")
    _failed(conn, schema, 3, age="10 minutes")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, created_at, run_at) VALUES"
        " ('send', 'mail', now() - interval '2 hours', now() + interval '1 day'),"
        " ('send', 'mail', now() - interval '5 minutes', now())"
    )
    hour = Filter(older_than=3600)
    assert _bulk.preview(conn, schema, "retry", hour).matched == 2
    assert _bulk.preview(conn, schema, "cancel", hour).matched == 1
    assert _bulk.preview(conn, schema, "retry", Filter(older_than=60)).matched == 5
    ids = [i for (i,) in conn.execute(f"SELECT id FROM {schema}.tasks ORDER BY id")]
    assert _bulk.preview(conn, schema, "retry", Filter(ids=(ids[0], ids[4]))).matched == 2
    both = Filter(ids=(ids[0], ids[4]), older_than=3600)
    assert _bulk.preview(conn, schema, "retry", both).matched == 1


# -- usage errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["delete"], "give a filter"),
        (["delete", "--yes"], "give a filter"),
        (["cancel"], "give a task id or a filter"),
        (["retry"], "give a task id, --failed, or a filter"),
        (["delete", "--older-than", "7x"], "expected a duration"),
        (["delete", "--older-than", "-1d"], "--older-than"),
        (["delete", "--older-than", "99999999d"], "at most 100 years"),
        (["delete", "--state", "finished"], "unknown state 'finished'"),
        (["delete", "--state", "in_progress"], "running tasks are never touched"),
        (["cancel", "--state", "failed"], "cancel applies to scheduled, queued tasks"),
        (["retry", "--state", "queued"], "retry applies to failed, cancelled tasks"),
        (["retry", "5", "--queue", "mail"], "not both"),
        (["cancel", "5", "--task", "x"], "not both"),
        (["retry", "--failed", "--state", "cancelled"], "not both"),
        (["delete", "--ids", "1,x"], "expected a whole number"),
        (["delete", "--ids", "0"], "expected 1 to"),
        (["delete", "--queue", ""], "queue must be a non-empty name"),
        (["delete", "--error", ""], "error must be a non-empty pattern"),
        (["delete", "--state", "done", "--batch-size", "0"], "expected 1 to 100000"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    pg_dsn: str, schema: str, conn: psycopg.Connection, args: list[str], match: str
) -> None:
    _mixed(conn, schema)
    before = _snapshot(conn, schema)
    r = run_cli(*args, *_common(pg_dsn, schema))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert match in r.stderr
    assert _snapshot(conn, schema) == before


def test_the_old_single_task_forms_still_work(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _failed(conn, schema, 2)
    common = _common(pg_dsn, schema)
    first, second = (i for (i,) in conn.execute(f"SELECT id FROM {schema}.tasks ORDER BY id"))
    assert run_cli("retry", str(first), *common).stdout.strip() == f"requeued task {first}"
    r = run_cli("cancel", str(first), *common)
    assert r.stdout.strip() == f"cancelled task {first} (it had not started)"
    r = run_cli("retry", "--failed", "--queue", "mail", *common)  # acts at once, as before
    assert r.stdout.strip() == "requeued 1 failed task(s)"
    assert states(conn, schema) == {"cancelled": 1, "queued": 1}
    assert conn.execute(f"SELECT count(*) FROM {schema}.actions").fetchone() == (0,)
    del second


# -- the record of actions -------------------------------------------------------------------------


def test_each_action_is_recorded_with_who_what_and_how_many_and_no_secret(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _mixed(conn, schema)
    secret = "s3cret-hunter2-pw"
    dsn = pg_dsn.replace("postgres@", f"postgres:{secret}@", 1)
    try:  # a server that checks passwords refuses this one: then only the plain DSN is used
        psycopg.connect(dsn, connect_timeout=5).close()
    except psycopg.Error:
        dsn = pg_dsn
    common = ["--dsn", dsn, "--schema", schema]
    r = run_cli("cancel", "--queue", "mail", "--older-than", "0s", "--yes", *common,
                env={"WORKER_ACTOR": ""})  # fmt: skip
    assert r.returncode == 0, r.stderr
    me = f"{getpass.getuser()}@{socket.gethostname()}"
    assert f"recorded as action #1 by {me}" in r.stdout
    r = run_cli(
        "delete", "--error", f"%password={secret}%", "--actor", f"ops via {dsn}", "--yes",
        "--json", *common,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = conn.execute(
        f"SELECT id, actor, source, action, filter, counts, finished_at IS NOT NULL"
        f" FROM {schema}.actions ORDER BY id"
    ).fetchall()
    assert rows[0][1:] == (
        me,
        "cli",
        "cancel",
        {"queue": "mail", "older_than": 0.0},
        {"matched": 6, "changed": 6, "batches": 2,
         "skipped": {"dedupe_key_taken": 0, "running": 0, "changed_meanwhile": 0}},
        True,
    )  # fmt: skip
    assert rows[1][3] == "delete" and rows[1][6]
    everything = conn.execute(f"SELECT string_agg(a::text, ' ') FROM {schema}.actions AS a")
    assert secret not in everything.fetchone()[0]
    assert secret not in r.stdout + r.stderr


def test_the_python_api_records_an_action_for_the_console(
    conn: psycopg.Connection, schema: str
) -> None:
    first = _audit.record_action(
        conn, schema, actor="ana", action="pause", filter={"queue": "mail"},
        counts={"changed": 1}, source="console 10.0.0.7",
    )  # fmt: skip
    second = _audit.record_action(
        conn, schema, actor="x" * 500, action="retry", filter={"ids": [42]},
        counts={"changed": 1}, source="console 10.0.0.7",
    )  # fmt: skip
    recent = _audit.recent_actions(conn, schema, limit=10)
    assert [a["id"] for a in recent] == [second, first]
    assert recent[0]["actor"] == "x" * 200 and recent[1]["filter"] == {"queue": "mail"}
    assert recent[1]["finished_at"] is not None


# -- interrupted by a signal ----------------------------------------------------------------------


def _action(conn: psycopg.Connection, schema: str) -> tuple[Any, ...] | None:
    """The latest action: id, finished_at, interrupted, counts (read as JSON, so that this runs
    on a schema from before the column too)."""
    return conn.execute(
        f"SELECT id, finished_at, to_jsonb(a) ->> 'interrupted', counts FROM {schema}.actions"
        " AS a ORDER BY id DESC LIMIT 1"
    ).fetchone()


@pytest.mark.parametrize(
    ("sig", "code", "as_json"), [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)]
)
def test_a_bulk_action_stopped_by_a_signal_ends_between_batches_and_says_how_far_it_got(
    pg_dsn: str, schema: str, conn: psycopg.Connection, sig: signal.Signals, code: int,
    as_json: bool,
) -> None:  # fmt: skip
    """100,000 failures, 100 a batch: a signal once some batches committed stops the action
    after the batch in flight. The record has the counts of the batches that committed (what
    the table shows), its finish time and the signal; one line (or the JSON) says so; the exit
    code is 128 + the signal's number. Before, SIGTERM killed it silently with counts {} and no
    finish time, and SIGINT printed nothing."""
    _failed(conn, schema, 100_000)
    extra = ["--json"] if as_json else []
    proc = spawn_cli(
        "retry", "--queue", "mail", "--yes", "--batch-size", "100", *extra,
        *_common(pg_dsn, schema), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        def changed() -> int:
            return states(conn, schema).get("queued", 0)

        wait_until(lambda: proc.poll() is not None or changed() >= 3_000, timeout=60, interval=0.01)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, (out, err)
    assert err == ""
    queued = states(conn, schema).get("queued", 0)
    assert states(conn, schema) == {"queued": queued, "failed": 100_000 - queued}
    assert 3_000 <= queued < 100_000 and queued % 100 == 0  # whole batches, none half-done
    action_id, finished_at, interrupted, counts = _action(conn, schema)
    assert finished_at is not None and interrupted == sig.name
    assert counts["changed"] == counts["matched"] == queued
    assert counts["batches"] == queued // 100
    if as_json:
        doc = json.loads(out)
        assert doc["interrupted"] == sig.name and doc["complete"] is False
        assert doc["changed"] == queued and doc["action_id"] == action_id
    else:
        assert out.splitlines() == [
            f"interrupted by {sig.name} after {queued // 100:,} batch(es): requeued {queued:,}"
            f" of the {queued:,} task(s) matched so far, matching state failed, queue 'mail';"
            f" recorded as action #{action_id} by {getpass.getuser()}@{socket.gethostname()};"
            " the rest are as they were: run it again to go on"
        ]
    # Run again, it does the rest.
    r = run_cli("retry", "--queue", "mail", "--yes", "--json", *_common(pg_dsn, schema))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["changed"] == 100_000 - queued
    assert states(conn, schema) == {"queued": 100_000}
    assert _action(conn, schema)[2] is None  # ran to its end


def test_a_second_signal_cancels_the_batch_in_flight_which_rolls_back_whole(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A batch that cannot go on (here: the table is locked) holds the first Ctrl-C's stop; the
    second cancels its statement, which rolls back, and the action ends as interrupted, having
    changed nothing."""
    _failed(conn, schema, 500)
    with psycopg.connect(pg_dsn) as locker:
        locker.execute(f"LOCK TABLE {schema}.tasks IN EXCLUSIVE MODE")
        proc = spawn_cli(
            "delete", "--queue", "mail", "--yes", *_common(pg_dsn, schema),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            wait_until(
                lambda: conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'worker/cli'"
                    " AND wait_event_type = 'Lock'"
                ).fetchone()[0],
                timeout=60,
            )
            proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
            assert proc.poll() is None  # the first waits for the batch in flight
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        locker.rollback()
    assert proc.returncode == 130, (out, err)
    assert out.startswith("interrupted by SIGINT before any batch committed: nothing deleted,")
    assert len(out.splitlines()) == 1 and err == ""
    assert states(conn, schema) == {"failed": 500}
    _, finished_at, interrupted, counts = _action(conn, schema)
    assert finished_at is not None and interrupted == "SIGINT"
    assert counts["changed"] == 0 and counts["batches"] == 0


# -- psql ------------------------------------------------------------------------------------------


def test_psql_runs_the_same_actions_in_batches_and_records_them(
    conn: psycopg.Connection, schema: str
) -> None:
    _failed(conn, schema, 30, error="TimeoutError: x")
    _failed(conn, schema, 5, error="ValueError: y")
    call = f"CALL {schema}.bulk('retry', %s::jsonb"
    flt = json.dumps({"error": "timeout%"})
    dry = conn.execute(call + ")", (flt,)).fetchone()
    assert dry == (30, 0, 0, 0, None)
    assert states(conn, schema) == {"failed": 35}
    done = conn.execute(call + ", dry_run => false, actor => 'dba', batch => 7)", (flt,))
    matched, changed, skipped, running, action_id = done.fetchone()
    assert (matched, changed, skipped, running) == (30, 30, 0, 0)
    assert states(conn, schema) == {"failed": 5, "queued": 30}
    per_xact = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE state = 'queued' GROUP BY xmin::text"
    ).fetchall()
    assert max(n for (n,) in per_xact) <= 7
    row = conn.execute(
        f"SELECT actor, source, action, filter, counts -> 'changed' FROM {schema}.actions"
        " WHERE id = %s",
        (action_id,),
    ).fetchone()
    assert row == ("dba", "sql", "retry", {"error": "timeout%"}, 30)
    for bad, message in [
        ({}, "give a filter"),
        ({"queu": "mail"}, "unknown filter key 'queu'"),
        ({"older_than": "-1 day"}, "must not be negative"),
        ({"ids": "1"}, "must be an array"),
    ]:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            conn.execute(call + ", dry_run => false)", (json.dumps(bad),))


def test_a_bulk_retry_of_a_task_cancelled_while_running_runs_it_to_done(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """A task someone cancelled while it ran keeps its cancel request in the row; retrying it
    must start it afresh, or its next run would end cancelled again whatever the handler did."""
    task_id = conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, finished_at,"
        " cancel_requested_at, cancelled_by) VALUES ('again', 'q', 'cancelled', 1, now(), now(),"
        " 'ops') RETURNING id"
    ).fetchone()[0]
    flt = _bulk.Filter(ids=(task_id,), states=("cancelled",))
    out = _bulk.apply(conn, schema, "retry", flt, actor="test")
    assert out.changed == 1
    assert conn.execute(
        f"SELECT state::text, cancel_requested_at, cancelled_by FROM {schema}.tasks WHERE id = %s",
        (task_id,),
    ).fetchone() == ("queued", None, None)
    reg = worker.Registry()
    reg.task("again", queue="q")(lambda p: None)
    with thread_worker(reg):
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,)
                ).fetchone()[0]
                in ("done", "cancelled")
            )
        )
    assert conn.execute(
        f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,)
    ).fetchone() == ("done",)
