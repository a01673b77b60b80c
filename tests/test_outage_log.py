"""A database outage is quiet in the log: per process, one line when the database is lost, one a
minute while it stays away (saying for how long), and one when it is back. An idle worker with
the database down used to write about three warnings a second (lease renewals with nothing to
renew, maintenance, the claim), thousands of lines over a long outage. And once the database
is back, a new task is claimed within five seconds (the pool's reconnect backoff used to reach
32 s)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import psycopg
from conftest import spawn_cli, wait_until
from test_faults import _prepare, _states
from test_pool import kill_tree, worker_env

from worker.dev.embedded import EmbeddedPostgres

# Longer than the one-minute reminder, so that the test sees one.
OUTAGE_SECONDS = 66.0
# A worker's log line: "<date> <time> LEVEL logger[pid] message".
LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<logger>\S+)\[(?P<pid>\d+)\] (?P<message>.*)$")


def test_a_long_outage_writes_a_few_lines_per_process(
    private_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    dsn = private_server.start()
    schema = "outage"
    _prepare(dsn, schema, 20)
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        sup = spawn_cli(
            "run", "faults_module", "--dsn", dsn, "--schema", schema, "--processes", "2",
            "--lease", "5", "--poll-interval", "0.5",
            env=worker_env(dsn, schema), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_until(lambda: _states(dsn, schema) == {"done": 20}, timeout=60, interval=0.2)
            time.sleep(2)  # idle: nothing to renew, nothing to claim
            before = len(log.read_text().splitlines())
            private_server.stop()
            down = time.monotonic()
            time.sleep(OUTAGE_SECONDS)
            assert private_server.start() == dsn
            up = time.monotonic()
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute(f"INSERT INTO {schema}.tasks (task, payload) VALUES ('record', '{{}}')")
            wait_until(lambda: _states(dsn, schema) == {"done": 21}, timeout=60, interval=0.2)
            with psycopg.connect(dsn, autocommit=True) as c:
                waited = c.execute(
                    "SELECT extract(epoch FROM started_at - created_at)::float8"
                    f" FROM {schema}.tasks ORDER BY id DESC LIMIT 1"
                ).fetchone()[0]  # type: ignore[index]
            assert waited < 5.0, waited  # claims resumed within five seconds of the restart
            time.sleep(2)
            assert sup.poll() is None
        finally:
            kill_tree(sup)
    lines = log.read_text().splitlines()[before:]
    parsed = [m for m in map(LINE.match, lines) if m]
    assert len(parsed) == len(lines), [x for x in lines if not LINE.match(x)]
    by_pid: dict[str, list[str]] = {}
    for m in parsed:
        by_pid.setdefault(m["pid"], []).append(m["message"])
    # The supervisor and its two workers: at most one line lost, one or two a minute, one back,
    # and one for anything else that happens once (a rescue, say).
    for pid, messages in by_pid.items():
        assert len(messages) <= 5, "\n".join([pid, *messages])
    workers = [m for pid, m in by_pid.items() if any("database back after" in x for x in m)]
    assert len(workers) >= 2, by_pid  # each worker process said it was back
    for messages in workers:
        lost = [x for x in messages if x.startswith("database unreachable")]
        still = [x for x in messages if x.startswith("database still unreachable after")]
        back = [x for x in messages if x.startswith("database back after")]
        assert len(lost) == 1 and len(back) == 1, messages
        assert len(still) == 1, messages  # the reminder a minute in
        seconds = float(re.search(r"back after (\d+(?:\.\d+)?) s", back[0])[1])
        assert OUTAGE_SECONDS - 5 <= seconds <= (up - down) + 30, back[0]
