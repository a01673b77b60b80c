"""A newcomer's first run, with real processes and real signals: `worker demo` runs until it is
told to stop and stops cleanly, counting only its own run; the embedded server lives in one
place per user, read-only commands never create one, each command says one line about it, and
`worker embedded stop` warns when workers are attached."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import ROOT, states, wait_until, worker_cli

import worker
from worker.cli.common import READ_ONLY_COMMANDS
from worker.cli.main import main
from worker.dev.demo import DEFAULT_CONSOLE_PORT, _console_port
from worker.dev.embedded import EmbeddedPostgres, default_data_dir

SUMMARY = re.compile(
    r"^demo: \d+s, (?P<enqueued>\d+) enqueued, (?P<done>\d+) done, (?P<retried>\d+) retried, "
    r"(?P<failed>\d+) failed, (?P<running>\d+) running, (?P<waiting>\d+) waiting, "
    r"(?P<cron_runs>\d+) cron runs, (?P<workers>\d+) workers$"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


# -- the demo ----------------------------------------------------------------------------------


def per_run(conn: psycopg.Connection, schema: str, after: int) -> dict[str, int]:
    row = conn.execute(
        f"SELECT count(*), count(*) FILTER (WHERE state = 'done'),"
        " count(*) FILTER (WHERE state = 'done' AND attempts > 1),"
        " count(*) FILTER (WHERE state = 'failed'),"
        " count(*) FILTER (WHERE cron_key IS NOT NULL AND state = 'done'),"
        " count(*) FILTER (WHERE state = 'in_progress')"
        f" FROM {schema}.tasks WHERE id > %s",
        (after,),
    ).fetchone()
    assert row is not None
    return dict(zip(("enqueued", "done", "retried", "failed", "cron", "running"), row, strict=True))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_demo_runs_until_signalled_and_stops_cleanly(
    sig: signal.Signals, pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """Producer, retries, a failure for good, the cron job and the console, all live; then one
    signal (Ctrl-C or SIGTERM) ends it with exit 0, no traceback, no process left behind, no
    task left running, and a last summary that counts this run only."""
    # An earlier run's rows: the summary must not count them.
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, state, finished_at)"
        " SELECT 'earlier', 'done', now() FROM generate_series(1, 7)"
    )
    after = conn.execute(f"SELECT max(id) FROM {schema}.tasks").fetchone()[0]
    port = free_port()
    proc = subprocess.Popen(
        worker_cli(
            "demo", "--dsn", pg_dsn, "--schema", schema, "--port", str(port), "--rate", "60"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"Console: http://127.0.0.1:{port}/console/" in first, first
        status, page = fetch(f"http://127.0.0.1:{port}/console/")
        assert status == 200 and "<html" in page.lower()

        full = sig == signal.SIGINT  # one run checks every part; the other only the stop

        def lively() -> bool:
            n = per_run(conn, schema, after)
            if not full:
                return n["done"] > 0
            return n["retried"] > 0 and n["failed"] > 0 and n["cron"] > 0

        wait_until(lively, timeout=20, interval=0.2)
        pool = children(proc.pid)
        assert len(pool) == 1  # the supervisor
        workers = children(pool[0])
        assert len(workers) == 2
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in out + err and err == "", err
    assert not any(alive(pid) for pid in [*pool, *workers])
    lines = out.splitlines()
    assert lines[-1].startswith("demo: stopped.") and "embedded" not in lines[-1]
    last = SUMMARY.match(lines[-2])
    assert last, lines[-2]
    counts = per_run(conn, schema, after)
    assert counts["running"] == 0
    assert int(last["enqueued"]) == counts["enqueued"]
    assert int(last["done"]) == counts["done"]
    assert int(last["failed"]) == counts["failed"]
    assert int(last["workers"]) == 0 and int(last["running"]) == 0
    if full:
        assert int(last["retried"]) >= counts["retried"] > 0
        assert int(last["cron_runs"]) >= counts["cron"] > 0
    live = conn.execute(f"SELECT count(*) FROM {schema}.workers WHERE stopped_at IS NULL")
    assert live.fetchone()[0] == 0


# -- the embedded server, per user ---------------------------------------------------------------


def test_default_data_dir_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKER_EMBEDDED_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_data_dir() == tmp_path / "data" / "worker" / "pgdata"
    for unset in ("", "relative/path"):  # the XDG spec: ignore a relative value
        monkeypatch.setenv("XDG_DATA_HOME", unset)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert default_data_dir() == tmp_path / "home" / ".local" / "share" / "worker" / "pgdata"
    monkeypatch.setenv("WORKER_EMBEDDED_DIR", str(tmp_path / "elsewhere"))
    assert default_data_dir() == tmp_path / "elsewhere"


class User:
    """A user with a home of their own (XDG_DATA_HOME), no DSN, and two project folders."""

    def __init__(self, root: Path) -> None:
        self.xdg = root / "xdg"
        self.a, self.b = root / "project-a", root / "project-b"
        self.a.mkdir()
        self.b.mkdir()
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("WORKER_DSN", "DATABASE_URL", "WORKER_EMBEDDED_DIR", "WORKER_SCHEMA")
        }
        self.env |= {"XDG_DATA_HOME": str(self.xdg), "PYTHONPATH": str(ROOT / "tests")}
        self.server = EmbeddedPostgres(self.xdg / "worker" / "pgdata")

    def cli(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            worker_cli(*args), cwd=cwd, env=self.env, capture_output=True, text=True, timeout=120
        )

    def spawn(self, *args: str, cwd: Path) -> subprocess.Popen[str]:
        return subprocess.Popen(
            worker_cli(*args),
            cwd=cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def server_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "embedded PostgreSQL" in line]


@pytest.fixture
def main_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """The real CLI entry point in this process (no interpreter start: these run in
    milliseconds), its logging set-up undone afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    yield run
    root.handlers[:], level = saved
    root.setLevel(level)


def no_dsn(monkeypatch: pytest.MonkeyPatch, xdg: Path) -> None:
    for name in ("WORKER_DSN", "DATABASE_URL", "WORKER_EMBEDDED_DIR", "WORKER_SCHEMA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(xdg))


def test_read_only_commands_never_create_a_server(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    main_in_process: Callable[..., tuple[int, str, str]],
) -> None:
    no_dsn(monkeypatch, tmp_path / "xdg")
    monkeypatch.chdir(tmp_path)
    pgdata = tmp_path / "xdg" / "worker" / "pgdata"
    assert {"status", "doctor", "wait", "cron", "locks"} == READ_ONLY_COMMANDS
    for args in (["status"], ["status", "--id", "1"], ["status", "--json"], ["doctor"],
                 ["doctor", "--json"], ["wait", "1"], ["cron"], ["locks"]):  # fmt: skip
        code, out, err = main_in_process(*args)
        assert code == 4, (args, out, err)  # the database cannot be reached
        if "--json" in args:  # the error as a JSON object too
            assert json.loads(out)["error"]["exit_code"] == 4, out
        else:
            assert out == "", (args, out)
        assert err.count("\n") == 1 and "is not running" in err, (args, err)
        assert str(pgdata) in err and "worker embedded start" in err
    assert not (tmp_path / "xdg").exists() and not (tmp_path / ".worker").exists()


def test_one_embedded_server_per_user(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    main_in_process: Callable[..., tuple[int, str, str]],
) -> None:
    """Created by the first command that writes, in the user's data folder; found from another
    folder; left running by the demo; one line about it per command, whatever the number of
    processes; `worker embedded stop` warns when workers are attached."""
    user = User(tmp_path)
    pgdata = user.xdg / "worker" / "pgdata"
    try:
        r = user.cli("migrate", cwd=user.a)
        assert r.returncode == 0, r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
        assert f"embedded PostgreSQL in {pgdata} (created it now)" in r.stderr
        assert not (user.a / ".worker").exists()
        worker.enqueue(user.server.dsn, "first.run", {})

        # Another folder finds the same queue.
        r = user.cli("status", "--json", cwd=user.b)
        assert r.returncode == 0, r.stderr
        assert r.stderr == ""  # --json: nothing but the JSON
        assert sum(q["counts"]["queued"] for q in json.loads(r.stdout)["queues"]) == 1

        # Stopping with no worker attached: no warning; a read-only command does not restart it.
        r = user.cli("embedded", "stop", cwd=user.b)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert "stopped the embedded PostgreSQL" in r.stdout
        assert not user.server.is_running()
        # Again: nothing to stop, and it says so instead of "stopped".
        r = user.cli("embedded", "stop", cwd=user.b)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert "is not running" in r.stdout and "stopped" not in r.stdout, r.stdout
        no_dsn(monkeypatch, user.xdg)
        monkeypatch.chdir(user.b)
        code, _, err = main_in_process("status")
        assert code == 4 and "is not running" in err
        assert not user.server.is_running()

        # The demo (three processes) in one folder, its queue seen from the other; Ctrl-C
        # leaves the server running, as the README says.
        demo = user.spawn("demo", "--port", str(free_port()), "--rate", "40", cwd=user.a)
        try:
            assert demo.stdout is not None
            assert "Console: http://127.0.0.1:" in demo.stdout.readline()
            with psycopg.connect(user.server.dsn, autocommit=True) as conn:
                wait_until(lambda: states(conn, "worker_demo").get("done"), timeout=20)
            code, out, err = main_in_process("status", "--schema", "worker_demo", "--json")
            assert code == 0 and err == ""
            assert any(q["counts"]["done"] for q in json.loads(out)["queues"])
            demo.send_signal(signal.SIGINT)
            out, err = demo.communicate(timeout=60)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()
        assert demo.returncode == 0, err
        assert len(server_lines(err)) == 1 and "(started it now)" in err, err
        assert "Traceback" not in err
        assert "The embedded PostgreSQL keeps running (`worker embedded stop` stops it)" in out
        assert user.server.is_running()

        # A worker attached: `worker embedded stop` warns, in one line, then stops.
        run = user.spawn("run", "tasks_module", "--processes", "1", cwd=user.b)
        try:
            with psycopg.connect(user.server.dsn, autocommit=True) as conn:
                sql = "SELECT count(*) FROM worker.workers WHERE stopped_at IS NULL"
                wait_until(lambda: conn.execute(sql).fetchone()[0] == 1, timeout=30)
            r = user.cli("embedded", "stop", cwd=user.a)
        finally:
            run.kill()
            run.communicate(timeout=30)
        assert r.returncode == 0
        warning = r.stderr.splitlines()
        assert len(warning) == 1 and "warning: 1 worker process(es) are attached" in warning[0]
        assert not user.server.is_running()
    finally:
        user.server.stop()


def test_the_console_moves_off_9187_when_it_is_taken() -> None:
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", DEFAULT_CONSOLE_PORT))
            taken.listen()
        except OSError:
            pass  # taken by someone else already: the same case
        port = _console_port(None)
        assert port != DEFAULT_CONSOLE_PORT
    assert _console_port(8123) == 8123  # --port is taken as given
