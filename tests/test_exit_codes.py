"""One exit-code table for every command: the same unreachable database gives the same code from
every command, `--json` prints an error object whatever failed, a reader that goes away ends the
command quietly, `worker embedded status` says stopped with a non-zero code, and the table in
`worker --help` is the one in the reference docs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from conftest import ROOT, run_cli

import worker
from worker.cli import exits

# Every test here runs `worker` processes (most try to reach a database).
pytestmark = pytest.mark.db

# A port nothing listens on (1 is privileged and never a PostgreSQL server's).
UNREACHABLE = "postgresql://app:pw@127.0.0.1:1/nodb"

# One command of each kind that talks to the database, with what it needs to get that far.
COMMANDS = [
    ["status"],
    ["status", "--id", "1"],
    ["doctor"],
    ["wait", "1", "--timeout", "1"],
    ["enqueue", "job", "--payload", "{}"],
    ["cron"],
    ["locks"],
    ["migrate"],
    ["pause", "q"],
    ["limits", "clear", "q"],
    ["retry", "--failed", "--yes"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_the_same_unreachable_database_gives_the_same_code(args: list[str]) -> None:
    r = run_cli(*args, "--dsn", UNREACHABLE, timeout=30)
    assert r.returncode == exits.UNREACHABLE, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "cannot connect to the database" in lines[0], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_json_prints_an_error_object_when_the_database_cannot_be_reached(args: list[str]) -> None:
    r = run_cli(*args, "--json", "--dsn", UNREACHABLE, timeout=30)
    assert r.returncode == exits.UNREACHABLE, (r.returncode, r.stdout, r.stderr)
    error = json.loads(r.stdout)["error"]
    assert error["exit_code"] == exits.UNREACHABLE and error["kind"] == "unreachable"
    assert error["message"].startswith("cannot connect to the database at ")
    assert "pw" not in r.stdout.replace("app:***", "")  # the password is not in it


def test_json_prints_an_error_object_for_a_usage_error_too() -> None:
    r = run_cli("status", "--json", "--no-such-flag")
    assert r.returncode == exits.USAGE
    assert json.loads(r.stdout)["error"] == {
        "message": "unrecognized arguments: --no-such-flag (see --help)",
        "exit_code": 2,
        "kind": "usage",
    }
    assert r.stderr == "worker: error: unrecognized arguments: --no-such-flag (see --help)\n"


def test_a_schema_that_is_not_there_is_a_usage_error_in_json(pg_dsn: str) -> None:
    r = run_cli("status", "--json", "--dsn", pg_dsn, "--schema", "no_such_schema_here")
    assert r.returncode == exits.USAGE, r.stderr
    assert json.loads(r.stdout)["error"]["kind"] == "usage"
    assert "worker migrate" in json.loads(r.stdout)["error"]["message"]


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["--help"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(
    pg_dsn: str, schema: str, args: list[str]
) -> None:
    """`worker status | true`: the reader is gone before the command writes. No traceback, no
    "Exception ignored" from the interpreter's last flush; the code says the pipe closed."""
    cmd = [sys.executable, "-m", "worker", *args, "--dsn", pg_dsn, "--schema", schema]
    if args == ["--help"]:
        cmd = [sys.executable, "-m", "worker", "--help"]
    script = " ".join(f"'{a}'" for a in cmd) + " | true; echo ${PIPESTATUS[0]} >&3"
    r = subprocess.run(
        ["bash", "-c", f"exec 3>&1; {{ {script}; }} 2>&1 1>/dev/null"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    *noise, code = r.stdout.splitlines()
    assert noise == [], r.stdout
    assert int(code) in (exits.OK, exits.CLOSED_PIPE), r.stdout


def test_a_reader_that_takes_one_line_ends_the_command_quietly(
    pg_dsn: str, schema: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """`worker status --json | head -1` over a larger output than the pipe holds."""
    for q in range(400):  # many paused queues: a JSON document of well over 64 KiB
        worker.pause_queue(conn, f"queue_{q:03}_" + "x" * 200, schema=schema)
    cmd = f"'{sys.executable}' -m worker status --json --dsn '{pg_dsn}' --schema {schema}"
    err = tmp_path / "stderr"
    r = subprocess.run(
        ["bash", "-c", f"{cmd} 2>'{err}' | head -1; cat '{err}'"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.stdout.splitlines()[0] == "{", r.stdout
    assert "Traceback" not in r.stdout and "BrokenPipe" not in r.stdout, r.stdout
    assert len(r.stdout.splitlines()) == 1, r.stdout


def test_embedded_status_is_non_zero_when_stopped(tmp_path: Path) -> None:
    r = run_cli("embedded", "status", env={"XDG_DATA_HOME": str(tmp_path)})
    assert r.returncode == exits.NO, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.startswith("stopped: ")


def test_version() -> None:
    r = run_cli("--version")
    assert r.returncode == 0 and re.fullmatch(r"worker \d+\.\d+\.\d+\S*\n", r.stdout), r.stdout


def test_the_help_and_the_reference_give_the_same_table() -> None:
    r = run_cli("--help")
    helped = set(re.findall(r"^  (\d+) ", r.stdout.split("exit codes")[1], re.M))
    doc = (ROOT / "docs" / "reference" / "exit-codes.md").read_text()
    table = doc.split("## Every command")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| (\d+) \|", table, re.M))
    assert helped == documented == {"0", "1", "2", "3", "4", "5", "130"}, (helped, documented)
    assert {"143", "141"} <= set(re.findall(r"\b(\d{3})\b", table))
