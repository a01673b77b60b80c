"""What producers wrote into rows reaches the terminal as visible text: no control sequence
(ESC, BEL, C1, newlines that forge lines) and no multi-megabyte line; JSON stays valid and exact
up to 64 KiB per string."""

from __future__ import annotations

import json

import psycopg
import pytest
from conftest import run_cli

from worker.cli.text import JSON_LIMIT, safe

TITLE = "\x1b]0;pwned\x07\x1b[2J"
HUGE = "x" * 5_000_000


@pytest.fixture
def hostile(conn: psycopg.Connection, schema: str) -> str:
    """Rows as a careless or malicious producer could write them, with plain SQL (before
    migration 0004, which refuses names over 255 characters at the insert)."""
    conn.execute(f"ALTER TABLE {schema}.tasks DROP CONSTRAINT tasks_task_length")
    conn.execute(f"ALTER TABLE {schema}.tasks DROP CONSTRAINT tasks_queue_length")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, last_error, finished_at)"
        " VALUES (%s, 'q', 'failed', 1, %s, now()),"
        " (%s, 'q', 'failed', 1, 'big', now()),"
        " ('plain', %s, 'failed', 1, %s, now()),"
        " ('c1', %s, 'queued', 0, NULL, NULL)",
        (
            "evil" + TITLE,
            "Boom\x1b[31m red\x08\x7f\x9b2J",
            HUGE,
            "line1\nline2\r\x1b[1A",
            "err\x1b]8;;http://x\x07link\x1b]8;;\x07 \u202egnp.exe",
            "q\x85\x9b",
        ),
    )
    conn.execute(
        f"INSERT INTO {schema}.workers (id, host, pid, queues, concurrency)"
        " VALUES (gen_random_uuid(), %s, 1, ARRAY[%s, 'ok'], 1)",
        ("host" + TITLE, "queue\n" + TITLE),
    )
    conn.execute(
        f"INSERT INTO {schema}.locks (name, holder, expires_at) VALUES (%s, %s, 'infinity')",
        ("lock" + TITLE, "holder\x1b[2J" + "h" * 100_000),
    )
    conn.execute(
        f"INSERT INTO {schema}.cron_schedules (key, expr, task, queue) VALUES (%s, %s, %s, %s)",
        ("key" + TITLE, "* * * * *", "task" + TITLE + HUGE, "q\n"),
    )
    return schema


def _assert_terminal_safe(text: str) -> None:
    bad = [c for c in text if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F]
    assert not bad, sorted(set(bad))
    assert len(text.encode()) < 64 * 1024, len(text)


@pytest.mark.parametrize("command", [["status"], ["locks"], ["cron"], ["status", "--failed", "50"]])
def test_human_output_shows_control_characters_as_text(
    pg_dsn: str, hostile: str, command: list[str]
) -> None:
    r = run_cli(*command, "--dsn", pg_dsn, "--schema", hostile)
    assert r.returncode == 0, r.stderr
    _assert_terminal_safe(r.stdout)
    _assert_terminal_safe(r.stderr)
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in r.stdout
    assert "more chars]" in r.stdout  # the 5 MB name was cut, and says so


def test_status_lines_cannot_be_forged_with_newlines(pg_dsn: str, hostile: str) -> None:
    r = run_cli("status", "--dsn", pg_dsn, "--schema", hostile)
    assert "line1\\x0aline2\\x0d" in r.stdout
    assert not any(line.startswith("line2") for line in r.stdout.splitlines())
    assert "\\u202egnp.exe" in r.stdout


@pytest.mark.parametrize("command", [["status"], ["locks"], ["cron"]])
def test_json_output_is_valid_exact_and_bounded(
    pg_dsn: str, hostile: str, command: list[str]
) -> None:
    r = run_cli(*command, "--json", "--dsn", pg_dsn, "--schema", hostile)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout
    data = json.loads(r.stdout)
    assert len(r.stdout) < 4 * JSON_LIMIT * 6 + 10_000
    text = json.dumps(data)
    if command == ["status"]:
        tasks = {f["task"] for f in data["failed"]}
        assert "evil" + TITLE in tasks  # exact when small
        cut = next(t for t in tasks if t.startswith("xxx"))
        assert len(cut) < JSON_LIMIT + 100 and cut.endswith(
            f"[{len(HUGE) - JSON_LIMIT} more chars]"
        )
    assert "pwned" in text


def test_safe_escapes_every_control_and_bounds() -> None:
    assert (
        safe("a\x00\t\n\x1b\x7f\x80\x9f\ud800z") == "a\\x00\\x09\\x0a\\x1b\\x7f\\x80\\x9f\\ud800z"
    )
    assert safe("é✓ ok") == "é✓ ok"
    cut = safe("\x1b" * 1000, 50)
    assert len(cut) < 80 and cut.startswith("\\x1b" * 12) and cut.endswith("more chars]")
