"""No password leaves the `worker` command: not in a message, a log line, JSON output, an error
from the driver, or a process's command line, whatever form the DSN takes, and a DSN that cannot
be parsed is not shown at all. (README: "passwords in DSNs are replaced by `***` in messages and
scrubbed from logs".)"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from conftest import run_cli, spawn_cli, wait_until
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from test_metrics import free_port

from worker.cli.text import SafeFormatter
from worker.db.dsn import UNPARSEABLE, redact, scrub
from worker.engine.supervisor import MAX_SECRET_BYTES, read_secret_pipe, secret_pipe

PW = "S3cretPW"
CLOSED = "127.0.0.1"  # port 1: nothing listens there

# A password in every form a DSN can carry it, all pointing at a closed port.
PARSEABLE = {
    "url": f"postgresql://bob:{PW}@{CLOSED}:1/db",
    "url-encoded": f"postgresql://bob:{PW}%2Fx@{CLOSED}:1/db",
    "query": f"postgresql://bob@{CLOSED}:1/db?password={PW}&connect_timeout=3",
    "keyvalue": f"host={CLOSED} port=1 user=bob password={PW}",
    "quoted": f"host={CLOSED} port=1 user=bob password='{PW} with blanks'",
}
MALFORMED = {
    "slash-in-url-password": f"postgresql://bob:{PW}/x@{CLOSED}/db",
    "blank-in-keyvalue": f"host={CLOSED} password={PW} x",
    "bad-percent": f"{PW}%zzPW",
    "bare": PW,
    "bad-percent-in-url": f"postgresql://bob:{PW}%zz@{CLOSED}:1/db",
    "word-as-port": f"postgresql://bob:{PW}@{CLOSED}:{PW}/db",
}


def _clean(r: subprocess.CompletedProcess[str]) -> None:
    out = r.stdout + r.stderr
    assert PW not in out, out
    assert "Traceback" not in out, out


# --- redaction and scrubbing, without a database -------------------------------------------


@pytest.mark.parametrize("dsn", PARSEABLE.values(), ids=PARSEABLE.keys())
def test_redact_hides_the_password_in_every_form(dsn: str) -> None:
    shown = redact(dsn)
    assert PW not in shown and "***" in shown
    assert CLOSED in shown


@pytest.mark.parametrize("dsn", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_dsn_that_cannot_be_parsed_is_not_shown(dsn: str) -> None:
    assert redact(dsn) == UNPARSEABLE


def test_redact_keeps_a_dsn_without_password() -> None:
    dsn = "postgresql://postgres@127.0.0.1:5432/postgres"
    assert redact(dsn) == dsn
    assert redact("host=h port=5 dbname=d") == "host=h port=5 dbname=d"


def test_scrub_removes_dsns_it_was_never_told_about() -> None:
    text = f"see postgresql://x:{PW}@h/db, or host=h password={PW}, or ?password={PW}"
    assert PW not in scrub(text)


def test_log_formatter_scrubs_dsns_in_messages_and_tracebacks() -> None:
    formatter = SafeFormatter("%(message)s")
    try:
        raise RuntimeError(f"boom: cannot use {PARSEABLE['url']}")
    except RuntimeError:
        record = logging.LogRecord(
            "w", logging.ERROR, __file__, 1, "dsn %s", (PARSEABLE["keyvalue"],), sys.exc_info()
        )
    text = formatter.format(record)
    assert PW not in text
    assert f"dsn host={CLOSED} port=1 user=bob password=***" in text
    assert f"RuntimeError: boom: cannot use postgresql://bob:***@{CLOSED}:1/db" in text


# --- passwords that are also words: masked where a DSN carries them, nowhere else -------------
#
# The compose demo's password is `worker`, also its user, its database and the product's name.
# Each case: a DSN, the password it carries, and what its redacted form must read.

WORDY = {
    "worker-everywhere": (
        "postgresql://worker:worker@postgres:5432/worker",
        "worker",
        "postgresql://worker:***@postgres:5432/worker",
    ),
    "one-letter": ("postgresql://a:a@a:5432/a", "a", "postgresql://a:***@a:5432/a"),
    "postgres": (
        "postgresql://postgres:postgres@postgres/postgres?sslmode=disable",
        "postgres",
        "postgresql://postgres:***@postgres/postgres?sslmode=disable",
    ),
    "percent-encoded": (
        "postgresql://worker:p%40ss%2Fw%3Ard@db:5432/worker",
        "p@ss/w:rd",
        "postgresql://worker:***@db:5432/worker",
    ),
    "query": (
        "postgresql://worker@db/worker?password=worker&application_name=worker",
        "worker",
        "postgresql://worker@db/worker?password=***&application_name=worker",
    ),
    "encoded-query-key": (
        "postgresql://worker@db/worker?pass%77ord=worker",
        "worker",
        "postgresql://worker@db/worker?pass%77ord=***",
    ),
    "keyvalue": (
        "host=worker user=worker password=worker dbname=worker",
        "worker",
        "host=worker user=worker password=*** dbname=worker",
    ),
    "keyvalue-quotes-and-blanks": (
        r"host=db user=worker password='it\'s \"a\" pass word' dbname=worker",
        'it\'s "a" pass word',
        "host=db user=worker password=*** dbname=worker",
    ),
    "sslpassword": (
        "host=db user=worker sslpassword=worker sslmode=require",
        "worker",
        "host=db user=worker sslpassword=*** sslmode=require",
    ),
}


@pytest.mark.parametrize("case", WORDY.values(), ids=WORDY.keys())
def test_redact_shows_a_dsn_whose_password_is_a_word(case: tuple[str, str, str]) -> None:
    """The redacted DSN is shown (never "cannot be parsed"), reads to libpq as the same DSN with
    the password masked, and keeps user, host and database even when they equal the password."""
    dsn, password, shown = case
    assert conninfo_to_dict(dsn).get("password", conninfo_to_dict(dsn).get("sslpassword")) == (
        password
    )
    assert redact(dsn) == shown
    assert redact(shown) == shown  # masking twice changes nothing
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    seen = {k: v for k, v in conninfo_to_dict(shown).items() if v is not None}
    assert seen == {k: ("***" if "password" in k else v) for k, v in params.items()}


@pytest.mark.parametrize("case", WORDY.values(), ids=WORDY.keys())
def test_scrub_masks_the_password_only_where_a_dsn_carries_it(case: tuple[str, str, str]) -> None:
    dsn, password, shown = case
    words = f"started {password} process 0; queue {password} ({password}), {password}s"
    assert scrub(words) == words
    assert scrub(f"cannot connect to {dsn}: refused") == f"cannot connect to {shown}: refused"
    if "://" in dsn:
        assert scrub(f'"{dsn}" {password}') == f'"{shown}" {password}'


def test_log_lines_of_a_worker_whose_password_is_worker() -> None:
    """Log records as `worker run` writes them (SafeFormatter), with the compose demo's DSN
    remembered nowhere: only DSN and password fields are masked."""
    formatter = SafeFormatter("%(levelname)s %(name)s %(message)s")
    dsn = WORDY["worker-everywhere"][0]

    def line(msg: str, *args: object) -> str:
        return formatter.format(logging.LogRecord("worker", logging.INFO, "f", 1, msg, args, None))

    assert line("started worker process %d (pid %d)", 0, 42) == (
        "INFO worker started worker process 0 (pid 42)"
    )
    assert line("worker %s started: queues=%s", "3f2a9c1b", "worker,default") == (
        "INFO worker worker 3f2a9c1b started: queues=worker,default"
    )
    assert line("database unavailable (%s); waiting 1.0s", f"{dsn} refused") == (
        "INFO worker database unavailable (postgresql://worker:***@postgres:5432/worker "
        "refused); waiting 1.0s"
    )
    assert line("conninfo %s", make_conninfo("", **conninfo_to_dict(dsn))) == (
        "INFO worker conninfo user=worker password=*** dbname=worker host=postgres port=5432"
    )
    assert line("env PGPASSWORD=worker POSTGRES_PASSWORD='worker' WORKER_USER=worker") == (
        "INFO worker env PGPASSWORD=*** POSTGRES_PASSWORD=*** WORKER_USER=worker"
    )
    assert line("%s", {"user": "worker", "password": "worker"}) == (
        "INFO worker {'user': 'worker', 'password': '***'}"
    )


# The texts psycopg and libpq give for a DSN carrying the password `worker` (captured from
# psycopg 3.3 with libpq 18), and what scrub leaves of them.
DRIVER_TEXTS = {
    # Refused, unknown host, bad password: the server's words, with the user name kept.
    'connection failed: connection to server at "127.0.0.1", port 1 failed: Connection refused': (
        'connection failed: connection to server at "127.0.0.1", port 1 failed: Connection refused'
    ),
    "failed to resolve host 'worker': [Errno -2] Name or service not known": (
        "failed to resolve host 'worker': [Errno -2] Name or service not known"
    ),
    'FATAL:  password authentication failed for user "worker"': (
        'FATAL:  password authentication failed for user "worker"'
    ),
    # Parse errors quote a fragment of the DSN, which may be the password: masked whole.
    'invalid percent-encoded token: "worker%zz"': 'invalid percent-encoded token: "***"',
    'unexpected spaces found in "wor ker", use percent-encoded spaces (%20) instead': (
        'unexpected spaces found in "***", use percent-encoded spaces (%20) instead'
    ),
    'missing "=" after "worker" in connection info string': (
        'missing "=" after "***" in connection info string'
    ),
    'missing key/value separator "=" in URI query parameter: "worker"': (
        'missing key/value separator "=" in URI query parameter: "***"'
    ),
    'end of string reached when looking for matching "]" in IPv6 host address in URI: '
    '"postgresql://worker:worker@[::1/worker"': (
        'end of string reached when looking for matching "]" in IPv6 host address in URI: "***"'
    ),
    'invalid dsn: invalid connection option "worker"': (
        'invalid dsn: invalid connection option "worker"'
    ),
}


@pytest.mark.parametrize("text", DRIVER_TEXTS, ids=range(len(DRIVER_TEXTS)))
def test_driver_texts_lose_dsn_fragments_and_keep_names(text: str) -> None:
    assert scrub(text) == DRIVER_TEXTS[text]


def test_the_driver_texts_are_the_drivers() -> None:
    """The parse errors above are what psycopg says today (a change of wording would make the
    masking miss them)."""
    for dsn in (
        "postgresql://worker:worker%zz@h/worker",
        "postgresql://worker:wor ker@h/worker",
        "host=h worker",
        "postgresql://worker@h/worker?worker",
        "postgresql://worker:worker@[::1/worker",
    ):
        with pytest.raises(psycopg.ProgrammingError) as err:
            conninfo_to_dict(dsn)
        text = str(err.value).strip()
        assert any(text in known for known in DRIVER_TEXTS), text
        assert "worker" not in scrub(text).partition('"')[2].replace("URI query", ""), text


@pytest.mark.parametrize("case", WORDY.values(), ids=WORDY.keys())
def test_a_refused_connection_shows_the_redacted_dsn(case: tuple[str, str, str]) -> None:
    """`worker status` against a closed port, the DSN by flag and by environment, as text and
    with --json: one line that names the redacted DSN, and the password nowhere in it."""
    dsn = case[0]
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params.update(host=CLOSED, port="1")
    closed = (
        make_conninfo(**params)
        if "://" not in dsn
        else dsn.replace("@postgres:5432", f"@{CLOSED}:1")
        .replace("@postgres/", f"@{CLOSED}:1/")
        .replace("@db:5432", f"@{CLOSED}:1")
        .replace("@db/", f"@{CLOSED}:1/")
        .replace("@a:5432", f"@{CLOSED}:1")
    )
    assert conninfo_to_dict(closed)["port"] == "1", closed
    shown = redact(closed)
    assert shown != UNPARSEABLE and "***" in shown
    for args, env in (
        (["status", "--dsn", closed], {}),
        (["status", "--json"], {"WORKER_DSN": closed}),
        (["migrate", "--json"], {"WORKER_DSN": closed}),
    ):
        r = run_cli(*args, env=env, timeout=30)
        assert r.returncode == 4, r.stderr  # the database cannot be reached
        assert r.stderr.count("\n") == 1, r.stderr
        assert UNPARSEABLE not in r.stderr + r.stdout
        # Word for word: the redacted DSN, and around it nothing masked.
        message = (
            "cannot connect to the database at <DSN>: connection failed: "
            f'connection to server at "{CLOSED}", port 1 failed: Connection refused '
            "(check --dsn, WORKER_DSN or DATABASE_URL)"
        )
        assert r.stderr.replace(shown, "<DSN>") == f"worker: error: {message}\n", r.stderr
        if "--json" in args:  # the same message in the JSON error object
            error = json.loads(r.stdout)["error"]
            assert error["message"].replace(shown, "<DSN>") == message, r.stdout
        else:
            assert not r.stdout


# --- real commands ------------------------------------------------------------------------

ALL = {**PARSEABLE, **MALFORMED}


@pytest.mark.db  # runs worker commands
@pytest.mark.parametrize("dsn", ALL.values(), ids=ALL.keys())
@pytest.mark.parametrize("via", ["flag", "env"])
def test_commands_never_print_the_password(dsn: str, via: str) -> None:
    flag = ["--dsn", dsn] if via == "flag" else []
    env = {"WORKER_DSN": dsn} if via == "env" else {"WORKER_DSN": "", "DATABASE_URL": ""}
    commands = [["migrate"], ["status", "--json"]]
    if via == "flag":
        commands += [
            ["enqueue", "job", "--payload", "{}"],
            ["run", "no_such_module_xyz"],
            ["run", "tasks_module", "--processes", "1"],
            ["dsn"],
        ]
    for args in commands:
        r = run_cli(*args, *flag, env=env, timeout=30)
        _clean(r)
        # 0 for `worker dsn` (it only parses); an unparseable DSN is bad input (2), a parseable
        # one that no server answers cannot be reached (4), except for a module that cannot be
        # imported, which `worker run` reports first (2).
        expected = 2 if dsn in MALFORMED.values() or args == ["run", "no_such_module_xyz"] else 4
        assert r.returncode == (0 if args == ["dsn"] and dsn in PARSEABLE.values() else expected), (
            args,
            r.stderr,
        )
        if dsn in MALFORMED.values() and args != ["run", "no_such_module_xyz"]:
            source = "--dsn" if via == "flag" else "WORKER_DSN"
            assert f"the DSN given by {source} cannot be parsed" in r.stderr


@pytest.mark.db  # runs worker commands
def test_migrate_with_a_bare_password_as_dsn_says_so_without_it() -> None:
    r = run_cli("migrate", "--dsn", PW)
    _clean(r)
    assert r.returncode == 2
    assert (
        r.stderr.strip().splitlines() == [r.stderr.strip()]
        and "the DSN given by --dsn cannot be parsed" in r.stderr
    )


def test_dsn_command_shows_the_password_only_when_asked() -> None:
    r = run_cli("dsn", "--dsn", PARSEABLE["url"])
    assert r.returncode == 0 and r.stdout.strip() == f"postgresql://bob:***@{CLOSED}:1/db"
    r = run_cli("dsn", "--dsn", PARSEABLE["url"], "--show-password")
    assert r.stdout.strip() == PARSEABLE["url"]


def _with_password(pg_dsn: str, form: str) -> str:
    """The test database's DSN with a password added (local connections are trusted, so it is
    ignored by the server but seen by every line of our code)."""
    params = {k: v for k, v in conninfo_to_dict(pg_dsn).items() if v is not None}
    params.pop("password", None)
    if form == "keyvalue":
        return make_conninfo(**params, password=PW)
    if form == "quoted":
        return make_conninfo(**params, password=f"{PW} x")
    host, port = params.get("host", "127.0.0.1"), params.get("port", "5432")
    user, db = params.get("user", "postgres"), params.get("dbname", "postgres")
    if form == "query":
        return f"postgresql://{user}@{host}:{port}/{db}?password={PW}"
    return f"postgresql://{user}:{PW}@{host}:{port}/{db}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ_has(pid: int, name: str) -> bool:
    try:
        return f"{name}=".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("form", ["url", "query", "keyvalue", "quoted"])
def test_a_worker_pool_shows_no_password_in_logs_or_command_lines(
    pg_dsn: str, schema: str, form: str, tmp_path: Path
) -> None:
    """`worker run --processes 2 --log-level DEBUG` with the DSN on its command line: the
    supervisor restarts itself with the DSN in its environment (WORKER_RUN_DSN, leaving the
    application's WORKER_DSN alone), its children get it the same way,
    and no log line shows it."""
    dsn = _with_password(pg_dsn, form)
    r = run_cli("migrate", "--dsn", dsn, "--schema", schema, "--json")
    _clean(r)
    assert r.returncode == 0, r.stderr
    r = run_cli("enqueue", "noop", "--dsn", dsn, "--schema", schema, "--payload", "{}")
    _clean(r)
    assert r.returncode == 0, r.stderr
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as fo, err.open("w") as fe:
        proc = spawn_cli(
            *("run", "tasks_module", "--dsn", dsn, "--listen-dsn", dsn, "--schema", schema),
            *("--processes", "2", "--log-level", "DEBUG", "--grace", "5"),
            stdout=fo,
            stderr=fe,
        )
        try:
            sup = psutil.Process(proc.pid)
            kids = wait_until(lambda: len(sup.children()) == 2 and sup.children(), timeout=30)
            time.sleep(1.0)  # let them log their start-up
            pids = [proc.pid, *(k.pid for k in kids)]
            lines = {pid: _cmdline(pid) for pid in pids}
            assert all(lines.values()), lines
            for pid, line in lines.items():
                assert PW not in line, (pid, line)
                assert "--dsn" not in line and "--listen-dsn" not in line, line
                assert _environ_has(pid, "WORKER_RUN_DSN")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                for kid in psutil.Process(proc.pid).children(recursive=True):
                    kid.kill()
                proc.kill()
                proc.wait()
    text = out.read_text() + err.read_text()
    assert "started worker process" in text  # the logs were on
    assert PW not in text, text
    assert "Traceback" not in text


# A mask that stands where a DSN or a password field carries the password.
_MASKED_FIELD = re.compile(r"://[^\s:@/]*:\*\*\*@|\b\w*password=\*\*\*", re.IGNORECASE)


@pytest.mark.parametrize("password", ["worker", "postgres"])
def test_a_worker_whose_password_is_a_word_logs_its_words(
    pg_dsn: str, schema: str, password: str, tmp_path: Path
) -> None:
    """The compose demo's case run for real: `worker run --processes 2` with a DSN whose
    password is `worker` (the product's name, in most of its log lines) or `postgres` (the user
    and database of the test server). Its logs, its status page, `migrate --json`, `enqueue` and
    `status --json` keep every word, and no `***` stands outside a DSN or password field; the
    page shows the redacted DSN; the start-up line names the address it binds."""
    params = {k: v for k, v in conninfo_to_dict(pg_dsn).items() if v is not None}
    params.pop("password", None)
    host, port = params.get("host", "127.0.0.1"), params.get("port", "5432")
    user, db = params.get("user", "postgres"), params.get("dbname", "postgres")
    dsn = f"postgresql://{user}:{password}@{host}:{port}/{db}"
    shown = f"postgresql://{user}:***@{host}:{port}/{db}"
    assert redact(dsn) == shown
    env = {"WORKER_DSN": dsn}
    outputs = []
    r = run_cli("migrate", "--schema", schema, "--json", env=env)
    assert r.returncode == 0, r.stderr
    outputs.append(r.stdout + r.stderr)
    r = run_cli("enqueue", password, "--queue", password, "--schema", schema, env=env)
    assert r.returncode == 0, r.stderr
    r = run_cli("status", "--schema", schema, "--json", env=env)
    assert r.returncode == 0, r.stderr
    outputs.append(r.stdout + r.stderr)
    assert {q["queue"] for q in json.loads(r.stdout)["queues"]} >= {password}

    metrics = free_port()
    log_path = tmp_path / "log"
    with log_path.open("w") as fh:
        proc = spawn_cli(
            *("run", "tasks_module", "--schema", schema, "--processes", "2", "--grace", "5"),
            *("--queues", f"default,{password}", "--log-level", "DEBUG"),
            *("--metrics-host", "0.0.0.0", "--metrics-port", str(metrics)),
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        try:
            from test_metrics import fetch

            _, page = wait_until(
                lambda: (got := fetch(f"http://127.0.0.1:{metrics}/"))[0] == 200 and got,
                timeout=60,
            )
            outputs.append(page)
            assert shown in page and UNPARSEABLE not in page
            started = re.compile(r"worker [0-9a-f]{8} started: queues=")
            wait_until(lambda: len(started.findall(log_path.read_text())) == 2, timeout=60)
        finally:
            _stop(proc)
    text = log_path.read_text()
    outputs.append(text)
    assert proc.returncode == 0, text
    assert "started worker process 0" in text and "started worker process 1" in text
    assert re.search(r"worker [0-9a-f]{8} started: queues=", text), text
    assert f"on 0.0.0.0:{metrics}, every IPv4 address of this machine " in text, text
    assert f"http://127.0.0.1:{metrics}/ from it" in text
    for out in outputs:
        rest = _MASKED_FIELD.sub("", out)
        assert "***" not in rest, [x for x in out.splitlines() if "***" in x]
        assert f":{password}@" not in out


def test_children_get_the_dsn_by_environment_only(pg_dsn: str, schema: str) -> None:
    """Without --dsn on the command line (WORKER_DSN), nothing is re-executed and the children's
    command lines still hold no DSN."""
    dsn = _with_password(pg_dsn, "url")
    proc = spawn_cli(
        *("run", "tasks_module", "--schema", schema, "--processes", "2"),
        env={"WORKER_DSN": dsn},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        sup = psutil.Process(proc.pid)
        kids = wait_until(lambda: len(sup.children()) == 2 and sup.children(), timeout=30)
        for pid in [proc.pid, *(k.pid for k in kids)]:
            assert PW not in _cmdline(pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert os.environ.get("WORKER_DSN") != dsn


@pytest.mark.parametrize("form", ["url", "query", "keyvalue", "quoted"])
@pytest.mark.parametrize("reachable", [True, False], ids=["up", "down"])
def test_no_password_on_any_http_surface(
    pg_dsn: str, schema: str, form: str, reachable: bool
) -> None:
    """The monitor's every surface (/, /readyz, /metrics, /healthz, a 404), with the DSN in each
    form, against a database that answers and one that does not (its error is shown)."""
    from test_metrics import fetch

    from worker.monitor.server import serve

    dsn = _with_password(pg_dsn, form)
    if not reachable:
        dsn = dsn.replace(str(conninfo_to_dict(pg_dsn).get("port", "5432")), "1", 1)
    server = serve("127.0.0.1", 0, dsn=dsn, schema=schema, ttl=0)
    try:
        for path in ("", "readyz", "metrics", "healthz", "nope"):
            status, body = fetch(server.url + path)
            assert status != 0, path
            assert PW not in body, (path, body[:300])
    finally:
        server.stop()


def test_the_benchmark_puts_no_password_on_its_workers_command_lines(pg_dsn: str) -> None:
    """`worker bench` starts real `worker run` processes for each phase: watched from outside
    while it runs, none of its descendants ever shows the DSN's password in its command line."""
    dsn = _with_password(pg_dsn, "url")
    tiny = ("--tasks", "300", "--processes", "2", "--concurrency", "10", "--light-rate", "0")
    # Every phase that starts workers runs, each as small as it goes: the workflow phases' own
    # pools (the fan-out's drains, the chain's two processes) are watched like the others.
    flows = ("--fanout", "20", "--fanout-runs", "1", "--chain", "10")
    proc = spawn_cli(
        "bench",
        *tiny,
        *flows,
        *("--latency-rate", "200", "--latency-tasks", "200", "--no-limit-phases"),
        env={"WORKER_DSN": dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    seen: dict[int, str] = {}
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                for kid in root.children(recursive=True):
                    seen.setdefault(kid.pid, _cmdline(kid.pid))
            time.sleep(0.02)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    workers = [line for line in seen.values() if " run " in line]
    assert len(workers) >= 2, seen  # the drain's pool and the latency phase's pool were watched
    for pid, line in seen.items():
        assert PW not in line, (pid, line)
    assert PW not in out + err


# --- the console's token ------------------------------------------------------------------

CONSOLE_TOKEN = "console-token-kept-in-memory-0123456789"


@pytest.mark.parametrize("memory", [True, False], ids=["memfd", "pipe"])
def test_a_secret_is_handed_over_once_by_file_descriptor(
    memory: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not memory:
        monkeypatch.delattr(os, "memfd_create", raising=False)
    secret = "tok\u00e9n-" * 1000  # 7 kB as UTF-8 for a memory file; under 4 KiB for a pipe
    secret = secret if memory else secret[:1000]
    fd = secret_pipe(secret)
    assert os.get_inheritable(fd)
    assert read_secret_pipe(str(fd)) == secret
    with pytest.raises(OSError):
        os.fstat(fd)  # read once, then closed
    with pytest.raises(ValueError):
        secret_pipe("x" * (MAX_SECRET_BYTES + 1 if memory else 4097))
    with pytest.raises(ValueError):
        read_secret_pipe("2")


def _traces(root: int) -> dict[int, str]:
    """The environment and command line of ``root`` and of every process below it, read from
    /proc as any process of the same user can."""
    pids = [root]
    with contextlib.suppress(psutil.Error):
        pids += [p.pid for p in psutil.Process(root).children(recursive=True)]
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode("latin-1")
            found[pid] = environ + "\n" + _cmdline(pid)
    return found


def _sign_in(port: int, token: str) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = urllib.parse.urlencode({"token": token, "name": "ops"})
    c.request(
        "POST",
        "/console/login",
        body=body,
        headers={
            "Content-Type": "application/x-www-form-urlencoded",
            "Origin": f"http://127.0.0.1:{port}",
        },
    )
    status = c.getresponse().status
    c.close()
    return status


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for kid in psutil.Process(proc.pid).children(recursive=True):
            kid.kill()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("processes", ["1", "2"])
def test_the_console_token_is_in_no_process_environment(
    pg_dsn: str, schema: str, conn: psycopg.Connection, processes: str, tmp_path: Path
) -> None:
    """`worker run --metrics-port` given WORKER_CONSOLE_TOKEN, alone and as a supervisor of two
    (given its DSN by flag, so that it also moves that): no process of the tree shows the token
    in /proc/PID/environ or cmdline, a handler finds it neither in os.environ nor in
    /proc/self/environ nor in its parent's, no log line holds it, and the console still takes
    it at sign-in."""
    conn.execute(f"INSERT INTO {schema}.tasks (task) VALUES ('environ')")
    port = free_port()
    dsn = ("--dsn", pg_dsn) if processes == "2" else ()
    log = tmp_path / "log"
    with log.open("w") as fh:
        proc = spawn_cli(
            *("run", "environ_module", *dsn, "--schema", schema, "--processes", processes),
            *("--metrics-port", str(port), "--store-results", "--max-result-size", "1000000"),
            *("--log-level", "DEBUG", "--grace", "5"),
            env={"WORKER_CONSOLE_TOKEN": CONSOLE_TOKEN, **({} if dsn else {"WORKER_DSN": pg_dsn})},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        try:
            row = wait_until(
                lambda: conn.execute(
                    f"SELECT result::text FROM {schema}.tasks WHERE state = 'done'"
                ).fetchone(),
                timeout=60,
            )
            result = json.loads(row[0])
            kids = 0 if processes == "1" else 2
            traces = wait_until(lambda: len(_traces(proc.pid)) == 1 + kids and _traces(proc.pid))
            for pid, trace in traces.items():
                assert CONSOLE_TOKEN not in trace, pid
                assert "WORKER_CONSOLE_TOKEN=" not in trace, pid
            assert result["parent"] == (proc.pid if kids else os.getpid())
            assert "WORKER_CONSOLE_TOKEN" not in result["os.environ"]
            assert CONSOLE_TOKEN not in row[0]
            assert _sign_in(port, "wrong-" + CONSOLE_TOKEN) == 403
            assert _sign_in(port, CONSOLE_TOKEN) == 303  # kept, in memory only
        finally:
            _stop(proc)
    text = log.read_text()
    assert "console (actions on)" in text and "failed sign-in" in text
    assert CONSOLE_TOKEN not in text and "Traceback" not in text


def test_a_worker_without_a_console_drops_the_token_too(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """WORKER_CONSOLE_TOKEN set for a `worker run` that serves no console (set for every unit of
    a machine, say): unused, and still out of reach of the handlers."""
    conn.execute(f"INSERT INTO {schema}.tasks (task) VALUES ('environ')")
    r = run_cli(
        *("run", "environ_module", "--schema", schema, "--processes", "1", "--burst"),
        "--store-results",
        *("--max-result-size", "1000000"),
        env={"WORKER_CONSOLE_TOKEN": CONSOLE_TOKEN, "WORKER_DSN": pg_dsn},
    )
    assert r.returncode == 0, r.stderr
    row = conn.execute(f"SELECT result::text FROM {schema}.tasks WHERE state = 'done'").fetchone()
    assert row is not None and '"/proc/self/environ"' in row[0]
    assert CONSOLE_TOKEN not in row[0] and "WORKER_CONSOLE_TOKEN" not in row[0]
    assert CONSOLE_TOKEN not in r.stdout + r.stderr


def test_the_demo_keeps_the_console_token_out_of_every_environment(
    pg_dsn: str, schema: str
) -> None:
    """`worker demo` given WORKER_CONSOLE_TOKEN: the demo, its pool's supervisor and the
    workers show it nowhere in /proc, and the console takes it at sign-in."""
    port = free_port()
    proc = spawn_cli(
        *("demo", "--dsn", pg_dsn, "--schema", schema, "--port", str(port), "--rate", "5"),
        env={"WORKER_CONSOLE_TOKEN": CONSOLE_TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert "Console:" in proc.stdout.readline()
        traces = wait_until(lambda: len(_traces(proc.pid)) == 4 and _traces(proc.pid))
        for pid, trace in traces.items():
            assert CONSOLE_TOKEN not in trace, pid
            assert "WORKER_CONSOLE_TOKEN=" not in trace, pid
        assert _sign_in(port, CONSOLE_TOKEN) == 303
    finally:
        _stop(proc)
        out, err = proc.communicate(timeout=10)
    assert CONSOLE_TOKEN not in out + err and "Traceback" not in out + err
