"""Hostile rows, written by a producer with plain SQL next to good tasks: each fails alone with a
readable reason (or is refused at the insert), the worker process never exits, the good tasks
all complete, and what is written to the table and the log stays bounded."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psycopg
import pytest
from conftest import every_statement, spawn_cli, states, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pool import kill_tree

from worker import store as tr
from worker.engine.job import clean_text, decode_payload, display

REFUSED = [
    ("run_at '-infinity'", "INSERT INTO {s}.tasks (task, run_at) VALUES ('h.ok', '-infinity')"),
    ("run_at 'infinity'", "INSERT INTO {s}.tasks (task, run_at) VALUES ('h.ok', 'infinity')"),
    ("5 MB task name", "INSERT INTO {s}.tasks (task) VALUES (repeat('x', 5000000))"),
    (
        "5 MB queue name",
        "INSERT INTO {s}.tasks (task, queue) VALUES ('h.ok', repeat('q', 5000000))",
    ),
]


@pytest.mark.parametrize(("what", "statement"), REFUSED, ids=[w for w, _ in REFUSED])
def test_rows_that_can_never_run_are_refused_at_the_insert(
    conn: psycopg.Connection, schema: str, what: str, statement: str
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(statement.format(s=schema))
    assert states(conn, schema) == {}


def _drop_guards(conn: psycopg.Connection, schema: str) -> None:
    """Rows from before migration 0004 (or from a producer who dropped its constraints): the
    worker must cope with them as well."""
    for name in ("tasks_run_at_finite", "tasks_task_length", "tasks_created_at_finite"):
        conn.execute(f"ALTER TABLE {schema}.tasks DROP CONSTRAINT {name}")


@pytest.mark.slow
def test_hostile_rows_fail_alone_and_the_worker_never_exits(
    pg_dsn: str, schema: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    _drop_guards(conn, schema)
    s = schema
    good = [
        r[0]
        for r in conn.execute(
            f"INSERT INTO {s}.tasks (task) SELECT 'h.ok' FROM generate_series(1, 300) RETURNING id"
        ).fetchall()
    ]
    hostile = {}
    for name, values in {
        "minus_infinity": "('h.ok', '{}', '-infinity', now())",
        "created_infinity": "('h.ok', '{}', now(), 'infinity')",
        "deep": "('h.ok', (repeat('[', 5000) || repeat(']', 5000))::jsonb, now(), now())",
        "digits": "('h.ok', ('[' || repeat('9', 5000) || ']')::jsonb, now(), now())",
        "nul_error": "('h.nul', '{}', now(), now())",
        "huge_error": "('h.echo', to_jsonb(repeat('e', 3000000)), now(), now())",
        "huge_unknown": "(repeat('u', 5000000), '{}', now(), now())",
        "escape_unknown": "(E'\\x1b]0;pwned\\x07\\x1b[2J', '{}', now(), now())",
    }.items():
        hostile[name] = conn.execute(
            f"INSERT INTO {s}.tasks (task, payload, run_at, created_at) VALUES {values}"
            " RETURNING id"
        ).fetchone()[0]
    good += [
        r[0]
        for r in conn.execute(
            f"INSERT INTO {s}.tasks (task) SELECT 'h.ok' FROM generate_series(1, 300) RETURNING id"
        ).fetchall()
    ]
    log = tmp_path / "worker.log"
    env = {"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": s}
    with open(log, "w") as err:
        proc = spawn_cli(
            "run", "hostile_module", "--schema", s, "--processes", "1", "--concurrency", "4",
            "--batch-size", "50", env=env, stderr=err,
        )  # fmt: skip
        try:

            def settled() -> bool:
                return (
                    conn.execute(
                        f"SELECT count(*) FROM {s}.tasks WHERE state IN ('queued', 'in_progress')"
                    ).fetchone()[0]
                    == 0
                )

            wait_until(settled, timeout=60)
            assert proc.poll() is None, "the worker process exited"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            kill_tree(proc)

    done = conn.execute(
        f"SELECT count(*) FROM {s}.tasks WHERE id = ANY(%s) AND state = 'done'", (good,)
    ).fetchone()[0]
    assert done == len(good)
    rows = {
        name: conn.execute(
            f"SELECT state::text, attempts, last_error FROM {s}.tasks WHERE id = %s", (i,)
        ).fetchone()
        for name, i in hostile.items()
    }
    # Times the driver cannot represent no longer break the claim: those tasks simply run.
    assert rows["minus_infinity"][0] == "done"
    assert rows["created_infinity"][0] == "done"
    for name in ("deep", "digits"):
        state, attempts, error = rows[name]
        assert (state, attempts) == ("failed", 1), rows[name]
        assert error.startswith("PayloadError: the payload cannot be decoded"), error
    state, _, error = rows["nul_error"]
    assert state == "failed" and error.startswith("ValueError: bad byte \\x00 here"), error
    assert "\\udc80" in error
    state, _, error = rows["huge_error"]
    assert state == "failed" and len(error) <= 4000, len(error)
    # Unknown names are handed back uncounted (a worker that has them may come), bounded too.
    for name in ("huge_unknown", "escape_unknown"):
        state, attempts, error = rows[name]
        assert (state, attempts) == ("scheduled", 0) and len(error) <= 4000, (name, len(error))
    assert rows["huge_unknown"][2].startswith("UnknownTask: no handler named 'uuuu")
    assert "\x1b" not in rows["escape_unknown"][2]
    text = log.read_text()
    assert "\x1b" not in text
    assert max(len(line) for line in text.splitlines()) < 10_000
    assert "Traceback" not in text


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_clean_text_always_fits_a_text_column_and_stays_bounded(text: str) -> None:
    cleaned = clean_text(text, limit=500)
    cleaned.encode("utf-8")  # no lone surrogate left
    assert "\x00" not in cleaned
    assert len(cleaned) <= 500


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_display_escapes_every_control_character_and_bounds_the_name(name: str) -> None:
    shown = display(name, limit=50)
    assert all(ch.isprintable() for ch in shown)
    assert len(shown) <= 50 * 10 + 40


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), lambda c: st.lists(c)))
def test_payloads_round_trip_through_the_claims_text(value: object) -> None:
    assert decode_payload(json.dumps(value)) == value


def _loads_or_error(text: str) -> tuple[str, object]:
    try:
        return ("ok", json.loads(text))
    except (ValueError, RecursionError) as exc:
        return ("error", type(exc).__name__)


def _decode_or_error(text: str) -> tuple[str, object]:
    try:
        return ("ok", decode_payload(text))
    except (ValueError, RecursionError) as exc:
        return ("error", type(exc).__name__)


_json_text = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda c: st.lists(c) | st.dictionaries(st.text(), c),
).map(json.dumps)


@settings(max_examples=400, deadline=None)
@given(
    _json_text | st.text(alphabet='{}[]":,0123456789.eE+-truefalsn \t\n\\u'),
    st.sampled_from(["", " ", "\n", "\t "]),
    st.sampled_from(["", " ", "\n", " x", ",1"]),
)
def test_payload_decoding_agrees_with_json_loads(body: str, before: str, after: str) -> None:
    """decode_payload skips json.loads' whitespace handling for the text PostgreSQL writes; on
    any other text (whitespace around it, trailing data, not JSON at all) it must still give
    what json.loads gives, error or value."""
    text = before + body + after
    assert _decode_or_error(text) == _loads_or_error(text)


_ODD_QUEUES = ["a,b", 'say "hi"', "back\\slash", "{brace}", "NULL", " spaced ", "ü\x1f", "x" * 255]


def test_queue_names_of_any_shape_reach_the_claim_as_written(
    conn: psycopg.Connection, schema: str
) -> None:
    """The claim sends its queue names to the server as array text (tr.text_array): commas,
    quotes, backslashes, braces, the word NULL and spaces in a producer's queue name must come
    back as the same name, so that each queue's row is claimed from that queue and no other."""
    q = every_statement(schema)
    for name in _ODD_QUEUES:
        conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('t', %s)", (name,))
    me = "00000000-0000-0000-0000-0000000000bb"
    for name in _ODD_QUEUES:
        rows = tr.claim(conn, q.schema, queues=[name], limit=10, worker_id=me, lease_seconds=30)
        assert [r.queue for r in rows] == [name]
    rows = tr.claim(conn, q.schema, queues=["NULL", "a"], limit=10, worker_id=me, lease_seconds=30)
    assert rows == []  # all taken, and "a" is not "a,b"
