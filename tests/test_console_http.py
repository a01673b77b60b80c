"""The operator console without a browser: request bodies stay bounded, every refused POST changes
nothing, the token never leaves the server, `worker run` takes the token only from a file or the
environment, the job browser's pages cover every matching row exactly once whatever the order,
and the throughput is the database's count."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
import tracemalloc
import urllib.parse
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import run_cli, spawn_cli, wait_until
from psycopg.conninfo import make_conninfo
from test_metrics import free_port
from test_monitor_hostile import assert_secure, headers_of, raw_request

from worker.coord import pause as _pause
from worker.monitor.console import data as console_data
from worker.monitor.console import throttle
from worker.monitor.console.data import ConsoleData
from worker.monitor.console.filter import STATES, Filter, walk_params
from worker.monitor.server import MetricsServer, serve
from worker.ops import actions as _console_actions

TOKEN = "http-test-token-abcdefghijklmnop"


@pytest.fixture
def armed(pg_dsn: str, schema: str) -> Iterator[MetricsServer]:
    server = serve(
        "127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0, console_token=TOKEN, request_timeout=2.0
    )
    yield server
    server.stop()


def request(
    server: MetricsServer,
    method: str,
    path: str,
    form: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], str]:
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = urllib.parse.urlencode(form) if form is not None else None
    sent = dict(headers or {})
    if body is not None:
        sent.setdefault("Content-Type", "application/x-www-form-urlencoded")
    c.request(method, path, body=body, headers=sent)
    r = c.getresponse()
    text = r.read().decode()
    got = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, got, text


def origin(server: MetricsServer) -> dict[str, str]:
    return {"Origin": f"http://127.0.0.1:{server.port}"}


def signed_in(server: MetricsServer) -> tuple[dict[str, str], str]:
    """(headers that carry the session, its CSRF token), signed in over plain HTTP."""
    status, headers, _ = request(
        server, "POST", "/console/login", {"token": TOKEN, "name": "bob"}, origin(server)
    )
    assert status == 303, status
    cookie = headers["set-cookie"].split(";")[0]
    session = {**origin(server), "Cookie": cookie}
    _, _, page = request(server, "GET", "/console/queues", headers=session)
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match
    return session, match.group(1)


# -- the HTTP server's bodies ----------------------------------------------------------------------


def test_request_bodies_are_bounded(armed: MetricsServer) -> None:
    head = b"POST /console/login HTTP/1.1\r\nHost: x\r\n"
    cases = {
        head + b"Content-Length: 20000\r\n\r\n" + b"a" * 100: 413,
        head + b"Content-Length: 99999999999999999\r\n\r\n": 413,
        head + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n": 501,
        head + b"Content-Length: abc\r\n\r\n": 400,
        head + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd": 400,
    }
    for data, want in cases.items():
        status, headers = headers_of(raw_request(armed, data))
        assert status == want, data[:80]
        assert_secure(headers)
    # A body that never arrives in full is cut off at the request timeout (2 s here).
    with socket.create_connection(("127.0.0.1", armed.port), timeout=5) as s:
        start = time.monotonic()
        s.sendall(head + b"Content-Length: 100\r\n\r\n" + b"x" * 10)
        raw = s.recv(4096)
        assert raw.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 2.0 + 1.5
    # Anything else than /console still does not take a POST.
    status, _ = headers_of(raw_request(armed, b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nab"))
    assert status == 501


# -- refusals --------------------------------------------------------------------------------------


def _state(conn: psycopg.Connection, schema: str) -> tuple[Any, ...]:
    return (
        conn.execute(f"SELECT id, state::text FROM {schema}.tasks ORDER BY id").fetchall(),
        conn.execute(f"SELECT queue FROM {schema}.paused_queues").fetchall(),
        conn.execute(f"SELECT count(*) FROM {schema}.actions").fetchall(),
    )


def test_every_refused_post_changes_nothing(
    armed: MetricsServer, schema: str, conn: psycopg.Connection, pg_dsn: str
) -> None:
    row = conn.execute(
        f"INSERT INTO {schema}.tasks (task, state, attempts, finished_at) VALUES"
        " ('t', 'failed', 1, now()) RETURNING id"
    ).fetchone()
    assert row is not None
    task_id = row[0]
    session, csrf = signed_in(armed)
    before = _state(conn, schema)
    path = f"/console/jobs/{task_id}/retry"
    cookie = {"Cookie": session["Cookie"]}
    refused = [
        ({"csrf": csrf}, cookie),  # no Origin, no Referer
        ({"csrf": csrf}, {**cookie, "Origin": "null"}),
        ({"csrf": csrf}, {**cookie, "Origin": "http://127.0.0.1:1"}),  # another port
        ({"csrf": csrf}, {**cookie, "Referer": "http://evil.example/console/"}),
        ({}, session),
        ({"csrf": csrf + "x"}, session),
        ({"csrf": csrf}, origin(armed)),  # no session
        ({"csrf": csrf}, {**session, "Cookie": "worker_console=forged"}),
    ]
    for form, headers in refused:
        status, _, text = request(armed, "POST", path, form, headers)
        assert status == 403, (form, headers, text[:200])
    status, _, _ = request(
        armed, "POST", path, None, {**session, "Content-Type": "application/json"}
    )
    assert status == 415
    assert _state(conn, schema) == before
    # With a Referer of this server instead of an Origin, the same request is accepted.
    referer = {"Cookie": session["Cookie"], "Referer": f"http://127.0.0.1:{armed.port}/console/"}
    status, headers, _ = request(armed, "POST", path, {"csrf": csrf}, referer)
    assert status == 303 and headers["location"] == f"/console/jobs/{task_id}"
    assert _state(conn, schema) != before
    # Signed out, the session is gone for good.
    status, _, _ = request(armed, "POST", "/console/logout", {"csrf": csrf}, session)
    assert status == 303
    status, _, text = request(armed, "POST", path, {"csrf": csrf}, session)
    assert status == 403 and "sign in first" in text
    # Read-only (no token): refused whatever the request carries.
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0)
    try:
        status, _, text = request(
            server, "POST", "/console/login", {"token": TOKEN}, origin(server)
        )
        assert status == 403 and "actions are off" in text
    finally:
        server.stop()


def test_the_token_never_leaves_the_server(
    armed: MetricsServer, schema: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    status, headers, text = request(
        armed, "POST", "/console/login", {"token": "wrong-" + TOKEN, "name": ""}, origin(armed)
    )
    assert status == 403 and "Wrong token" in text and "set-cookie" not in headers
    status, headers, _ = request(
        armed,
        "POST",
        "/console/login",
        {"token": f"  {TOKEN}\n", "name": "\x1b[31mx"},
        origin(armed),
    )
    assert status == 303
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/console" in cookie
    assert TOKEN not in cookie
    session, csrf = signed_in(armed)
    request(armed, "POST", "/console/queues/pause", {"csrf": csrf, "queue": "q1"}, session)
    assert conn.execute(f"SELECT paused_by FROM {schema}.paused_queues").fetchall() == [("bob",)]
    seen = [text, cookie]
    for path in (
        "/",
        "/metrics",
        "/readyz",
        "/console/",
        "/console/jobs",
        "/console/queues",
        "/console/cron",
        "/console/locks",
        "/console/login",
        "/console/jobs/1",
    ):
        seen.append(request(armed, "GET", path, headers=session)[2])
    seen += [r.getMessage() for r in caplog.records]
    seen += [str(r) for r in conn.execute(f"SELECT * FROM {schema}.actions").fetchall()]
    assert not [s for s in seen if TOKEN in s]
    assert any("failed sign-in from 127.0.0.1" in m for m in seen)
    assert any("bob from 127.0.0.1: pause" in m for m in seen)
    # The name given with control characters is not kept as given: the default stands.
    assert any("console signed in from" in m for m in seen)


# -- `worker run` ----------------------------------------------------------------------------------


@pytest.mark.db  # runs `worker run`
def test_run_takes_the_token_only_from_a_file_or_the_environment(tmp_path: Path) -> None:
    secret = "s3cret-console-token-on-the-command-line"
    short = tmp_path / "short"
    short.write_text("tooshort123\n")
    port = ("--metrics-port", "9")
    cases = [
        ((*port, "--console-token", secret), {}, "--console-token is not accepted"),
        ((*port, f"--console-token={secret}"), {}, "--console-token is not accepted"),
        (("--console-token-file", str(short)), {}, "needs --metrics-port"),
        ((*port, "--console-token-file", str(tmp_path / "nope")), {}, "cannot read"),
        ((*port, "--console-token-file", str(short)), {}, "--console-token-file is too short"),
        (port, {"WORKER_CONSOLE_TOKEN": "tooshort123"}, "WORKER_CONSOLE_TOKEN is too short"),
        (port, {"WORKER_CONSOLE_TOKEN": "x" * 70_000}, "WORKER_CONSOLE_TOKEN must be one line"),
        (port, {"WORKER_CONSOLE_TOKEN_FD": "99"}, "cannot read the console token"),
        (port, {"WORKER_CONSOLE_TOKEN_FD": "1"}, "cannot read the console token"),
        ((*port, "--console-host", "evil.example/x"), {}, "--console-host: 'evil.example/x' is"),
        (port, {"WORKER_CONSOLE_HOSTS": "a.example, b c"}, "WORKER_CONSOLE_HOSTS: 'b c' is not"),
    ]
    for args, env, message in cases:
        r = run_cli("run", "tasks_module", *args, env=env)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.splitlines()) == 1, r.stderr
        assert secret not in r.stderr + r.stdout and "tooshort123" not in r.stderr


def test_a_supervisor_serves_an_armed_console_and_hides_the_token(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    proc = spawn_cli(
        "run",
        "tasks_module",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        "--processes",
        "2",
        "--metrics-port",
        str(port),
        "--console-token-file",
        str(token_file),
        env={"WORKER_CONSOLE_HOSTS": "ops.example,ops.example:8443"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def login_form() -> bool:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/console/login")
                return 'name="token"' in c.getresponse().read().decode()
            except OSError:
                return False

        wait_until(login_form, timeout=30, interval=0.2)
        for host, want in (("ops.example", 200), (f"localhost:{port}", 200), ("x.example", 421)):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/console/", headers={"Host": host})
            assert c.getresponse().status == want, host
            c.close()
        children = wait_until(
            lambda: _children(proc.pid) if len(_children(proc.pid)) == 2 else [], timeout=30
        )
        for pid in [proc.pid, *children]:
            assert TOKEN not in Path(f"/proc/{pid}/cmdline").read_text()
        for pid in children:
            assert TOKEN not in Path(f"/proc/{pid}/environ").read_bytes().decode("latin-1")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "console (actions on)" in out and TOKEN not in out


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


# -- the job browser's pages -----------------------------------------------------------------------


@pytest.fixture
def varied(schema: str, conn: psycopg.Connection) -> str:
    """Rows in every state, in two queues and three tasks, with ties on the sort keys (rows
    written by one statement share their timestamps), priorities, and finished rows written by
    hand without a finished_at."""
    s = schema
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, priority, payload)"
        " SELECT 't' || (g % 3), 'q' || (g % 2), (g % 3) - 1, jsonb_build_object('n', g)"
        " FROM generate_series(1, 40) g"
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, run_at, payload)"
        " SELECT 't' || (g % 3), 'q' || (g % 2), now() + interval '1 hour' * (g % 4),"
        " jsonb_build_object('n', g) FROM generate_series(1, 30) g"
    )
    for state, error in (("done", None), ("failed", "Boom needle"), ("cancelled", None)):
        conn.execute(
            f"INSERT INTO {s}.tasks (task, queue, state, attempts, finished_at, last_error)"
            f" SELECT 't' || (g %% 3), 'q' || (g %% 2), '{state}', 1,"
            " now() - interval '1 minute' * (g %% 5), %s FROM generate_series(1, 35) g",
            (error,),
        )
        conn.execute(
            f"INSERT INTO {s}.tasks (task, queue, state, attempts, last_error)"
            f" SELECT 't0', 'q0', '{state}', 1, %s FROM generate_series(1, 9)",
            (error,),
        )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, state, attempts, started_at, lease_expires_at)"
        " SELECT 't1', 'q1', 'in_progress', 1, now(), now() + interval '1 minute'"
        " FROM generate_series(1, 11)"
    )
    return s


def _walk(data: ConsoleData, f: Filter) -> list[int]:
    """Every id the browser lists for ``f``, following its links to the end."""
    ids: list[int] = []
    cursor = None
    for _ in range(500):
        page = data.browse(f, cursor, limit=7)
        assert page.error is None
        ids += [r["id"] for r in page.rows]
        cursor = page.next_cursor or page.scanned_to
        if cursor is None:
            return ids
    raise AssertionError("the pages never ended")


def test_browser_pages_list_every_match_once_in_order(
    pg_dsn: str, varied: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console_data, "SCAN_ROWS", 13)  # filters that narrow the walk page on
    data = ConsoleData(pg_dsn, varied)
    try:
        filters = [Filter()]
        for state in STATES:
            filters += [Filter(state=state), Filter(state=state, queue="q0")]
            filters += [Filter(state=state, task="t1"), Filter(state=state, text="NEEDLE")]
        filters += [Filter(queue="q1"), Filter(task="t2", queue="q0"), Filter(text='"n": 1')]
        for f in filters:
            ids = _walk(data, f)
            where = ["true"]
            params: list[Any] = []
            for column, value in (("state::text", f.state), ("queue", f.queue), ("task", f.task)):
                if value:
                    where.append(f"{column} = %s")
                    params.append(value)
            if f.text:
                where.append("(payload::text ILIKE %s OR last_error ILIKE %s)")
                params += [f.pattern(), f.pattern()]
            truth = conn.execute(
                f"SELECT id FROM {varied}.tasks WHERE {' AND '.join(where)}", params
            ).fetchall()
            assert len(ids) == len(set(ids)), f"{f}: listed twice"
            assert sorted(ids) == sorted(i for (i,) in truth), f
            assert ids == _ordered(conn, varied, f.mode, ids), f
    finally:
        data.close()


def _ordered(conn: psycopg.Connection, schema: str, mode: str, ids: list[int]) -> list[int]:
    order = {
        "any": "id DESC",
        "running": "id DESC",
        "queued": "queue, -priority, run_at, id",
        "scheduled": "run_at, id",
        "finished": "finished_at DESC NULLS FIRST, id DESC",
        "failed": "finished_at DESC NULLS FIRST, id DESC",
    }[mode]
    rows = conn.execute(
        f"SELECT id FROM {schema}.tasks WHERE id = ANY(%s) ORDER BY {order}", (ids,)
    ).fetchall()
    return [i for (i,) in rows]


def test_a_cursor_from_anywhere_is_read_safely() -> None:
    for junk in ("", "!!", "W10", "WyJhbnkiXQ", "WyJhbnkiLCJ4Il0", "x" * 5000):
        for mode in ("any", "queued", "scheduled", "finished", "failed", "running"):
            assert walk_params(mode, junk) == walk_params(mode, None)


# -- throughput ------------------------------------------------------------------------------------


def test_throughput_is_the_databases_count_and_replicas_agree(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    now = conn.execute("SELECT date_trunc('minute', now())").fetchone()[0]  # type: ignore[index]
    for minutes_ago, done, failed in ((0, 3, 1), (1, 5, 0), (7, 2, 2), (59, 4, 0), (61, 9, 9)):
        at = now - timedelta(minutes=minutes_ago) + timedelta(seconds=1)
        for state, n in (("done", done), ("failed", failed), ("cancelled", 1)):
            conn.execute(
                f"INSERT INTO {schema}.tasks (task, state, attempts, finished_at)"
                f" SELECT 't', '{state}', 1, %s FROM generate_series(1, %s)",
                (at, n),
            )
    one, two = ConsoleData(pg_dsn, schema, ttl=0), ConsoleData(pg_dsn, schema, ttl=0)
    try:
        results = []
        for data in (one, two):
            for _ in range(5):  # the settled minutes come in over a few refreshes
                tp = data.throughput()
            assert tp.error is None and tp.pending == 0 and len(tp.minutes) == 60
            results.append([(m.at, m.done, m.failed) for m in tp.minutes])
        assert results[0] == results[1]
        by_age = {round((now - at).total_seconds() / 60): (d, f) for at, d, f in results[0]}
        assert by_age[0] == (3, 1) and by_age[1] == (5, 0) and by_age[7] == (2, 2)
        assert by_age[59] == (4, 0) and 61 not in by_age
        assert sum(d for d, _ in by_age.values()) == 14
    finally:
        one.close()
        two.close()


# -- pause and resume (the core module the workers will read) ------------------------------------


def test_pause_is_recorded_once_and_resume_removes_it(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert _pause.pause(conn, schema, "mail", "alice") is True
        assert _pause.pause(conn, schema, "mail", "bob") is False  # the first pause stands
        assert [(p.queue, p.paused_by) for p in _pause.paused(conn, schema)] == [("mail", "alice")]
        assert _pause.resume(conn, schema, "mail") is True
        assert _pause.resume(conn, schema, "mail") is False
        assert _pause.paused(conn, schema) == []
        for bad in ("", "q" * 256):
            with pytest.raises(ValueError, match="1 to 255 characters"):
                _pause.pause(conn, schema, bad, "alice")


def test_the_console_warns_when_it_pauses_a_queue_nothing_has_named(
    armed: MetricsServer, schema: str, conn: psycopg.Connection
) -> None:
    """The pause is made, as from the CLI, with the same warning as a second flash message."""
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('t', 'emails')")
    session, csrf = signed_in(armed)
    flashes = []
    for queue in ("emails", "emials"):
        form = {"csrf": csrf, "queue": queue}
        status, headers, _ = request(armed, "POST", "/console/queues/pause", form, session)
        assert status == 303 and headers["location"] == "/console/queues"
        page = request(armed, "GET", headers["location"], headers=session)[2]
        flashes.append(re.findall(r'<div class="flash" role="status">([^<]*)</div>', page))
    assert flashes == [
        ["queue emails paused"],
        [
            "queue emials paused",
            "warning: no task, worker, limit, pause or recent action has named queue "
            "&#x27;emials&#x27;: paused it all the same (for tasks still to come); did you mean "
            "&#x27;emails&#x27;? known queues: &#x27;emails&#x27;",
        ],
    ]
    assert sorted(p.queue for p in _pause.paused(conn, schema)) == ["emails", "emials"]


# -- bounds ----------------------------------------------------------------------------------------


def test_a_bulk_action_takes_a_bounded_number_of_tasks(
    armed: MetricsServer, schema: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_console_actions, "MAX_IDS", 5)
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, finished_at)"
        " SELECT 't', 'b', 'failed', 1, now() FROM generate_series(1, 12)"
    )
    session, csrf = signed_in(armed)
    form = {"csrf": csrf, "action": "retry", "queue": "b", "state": "failed"}
    flashes = []
    for _ in range(3):
        status, headers, _ = request(armed, "POST", "/console/jobs/bulk", form, session)
        assert status == 303 and headers["location"] == "/console/jobs?queue=b&state=failed"
        page = request(armed, "GET", headers["location"], headers=session)[2]
        flashes.append(re.findall(r'<div class="flash" role="status">([^<]*)</div>', page))
    assert flashes == [
        ["retry: 5 of 5 matching task(s) changed; more may match: run it again"],
        ["retry: 5 of 5 matching task(s) changed; more may match: run it again"],
        ["retry: 2 of 2 matching task(s) changed"],
    ]
    assert conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE state = 'queued'"
    ).fetchone() == (12,)
    # Without a filter there is nothing to confirm.
    status, _, _ = request(armed, "GET", "/console/jobs/bulk?action=retry", headers=session)
    assert status == 400


def test_a_huge_payload_and_error_are_cut_on_the_task_page(
    armed: MetricsServer, schema: str, conn: psycopg.Connection
) -> None:
    row = conn.execute(
        f"INSERT INTO {schema}.tasks (task, state, attempts, finished_at, payload, last_error)"
        " VALUES ('t', 'failed', 1, now(), jsonb_build_object('blob', repeat('p', 1000000)),"
        " repeat('e', 1000000)) RETURNING id"
    ).fetchone()
    assert row is not None
    status, _, page = request(armed, "GET", f"/console/jobs/{row[0]}")
    assert status == 200 and len(page) < 200_000
    assert "p" * 60_000 in page and "p" * 70_000 not in page
    assert "e" * 60_000 in page and "more characters]" in page
    status, _, page = request(armed, "GET", "/console/jobs?state=failed")
    assert status == 200 and len(page) < 50_000


def test_with_the_database_down_pages_say_so_at_once_without_the_password(schema: str) -> None:
    down = make_conninfo(host="127.0.0.1", port="1", user="u", password="s3cr3t-pw", dbname="x")
    server = serve("127.0.0.1", 0, dsn=down, schema=schema, ttl=0, console_token=TOKEN)
    try:
        for path in ("/console/", "/console/jobs", "/console/jobs/1", "/console/queues"):
            start = time.monotonic()
            status, _, text = request(server, "GET", path)
            assert status == 503 and "s3cr3t-pw" not in text, path
            assert "database problem" in text or "connection" in text, path
            assert time.monotonic() - start < 3.0, path
    finally:
        server.stop()


def test_the_task_page_shows_each_attempts_error_escaped_and_bounded(
    armed: MetricsServer, schema: str, conn: psycopg.Connection
) -> None:
    """The error history, newest first: a hostile history written by SQL (markup in the errors,
    a thousand entries, one entry not an object) shows ten rows, escaped; a history that is not
    an array shows none, and the page still renders."""
    row = conn.execute(
        f"INSERT INTO {schema}.tasks (task, state, attempts, finished_at, errors)"
        " SELECT 't', 'failed', 1000, now(), jsonb_agg(CASE WHEN i = 999 THEN to_jsonb(i) ELSE"
        " jsonb_build_object('attempt', i, 'at', now(), 'error',"
        " '<b id=\"x' || i || '\">boom ' || i || '</b>' || repeat('e', 10000)) END"
        " ORDER BY i) FROM generate_series(1, 1000) AS i RETURNING id"
    ).fetchone()
    assert row is not None
    status, _, page = request(armed, "GET", f"/console/jobs/{row[0]}")
    assert status == 200 and len(page) < 200_000
    assert '<table id="attempts">' in page
    shown = [i for i in range(1, 1001) if f"&lt;b id=&quot;x{i}&quot;&gt;boom {i}" in page]
    assert shown == [991, 992, 993, 994, 995, 996, 997, 998, 1000], shown  # 999 is not an object
    assert '<b id="x' not in page and "e" * 4001 not in page
    conn.execute(f"UPDATE {schema}.tasks SET errors = '\"oops\"' WHERE id = %s", (row[0],))
    status, _, page = request(armed, "GET", f"/console/jobs/{row[0]}")
    assert status == 200 and "No attempt has failed." in page


# -- sign-in throttling ----------------------------------------------------------------------------


def _login(server: MetricsServer, token: str, source: str = "127.0.0.1") -> tuple[int, dict]:
    """A sign-in over HTTP from the loopback address ``source`` (any of 127.0.0.0/8)."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10, source_address=(source, 0))
    c.request(
        "POST",
        "/console/login",
        body=urllib.parse.urlencode({"token": token, "name": "ops"}),
        headers={"Content-Type": "application/x-www-form-urlencoded", **origin(server)},
    )
    r = c.getresponse()
    r.read()
    got = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, got


def test_sign_in_is_throttled_per_address_with_a_bounded_log(
    armed: MetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """2,000 wrong tokens from one address: the first failures are refused as wrong, then the
    address is locked and every attempt is refused with 429 and Retry-After, the right token
    too, until the lock ends; a few log lines say so, none per attempt. Another address signs
    in meanwhile. (The throttle's clock is the test's, so the lock ends when the test says.)"""
    caplog.set_level("DEBUG", logger="worker.console")
    now = [1000.0]
    armed.console.auth.throttle.clock = lambda: now[0]
    statuses: dict[int, int] = {}
    for _ in range(2000):
        status, headers = _login(armed, "wrong-" + TOKEN)
        statuses[status] = statuses.get(status, 0) + 1
    assert statuses == {403: 4, 429: 1996}, statuses
    status, headers = _login(armed, TOKEN)  # the right token, during the lock
    assert status == 429 and "set-cookie" not in headers
    assert headers["retry-after"] == "60" and headers["x-content-type-options"] == "nosniff"
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert _login(armed, TOKEN, source="127.0.0.2")[0] == 303  # another address: unaffected
    assert _login(armed, "wrong-" + TOKEN, source="127.0.0.3")[0] == 403
    now[0] += 59
    assert _login(armed, TOKEN)[0] == 429
    now[0] += 1
    status, headers = _login(armed, TOKEN)  # the lock is over
    assert status == 303 and "worker_console=" in headers["set-cookie"]
    lines = [r.getMessage() for r in caplog.records if "sign-in" in r.getMessage()]
    assert len(lines) <= 5, lines
    assert "console: failed sign-in from 127.0.0.1 (wrong token)" in lines
    assert "console: 5 failed sign-ins from 127.0.0.1 in the last 1 s; locked for 60 s" in lines
    assert "console: 1,997 sign-ins from 127.0.0.1 refused while it was locked (60 s)" in lines
    assert not [m for m in lines if TOKEN in m]


def test_the_throttle_backs_off_and_forgets() -> None:
    now = [0.0]
    t = throttle.SignInThrottle(clock=lambda: now[0])
    # Four failures a minute apart never lock; five within a minute do.
    for _ in range(4):
        assert t.failed("a") == 0
        now[0] += 61
    assert [t.failed("b") for _ in range(5)] == [0, 0, 0, 0, 60]
    # Each failure after a lock locks again, for twice as long, up to the cap.
    locks = []
    for _ in range(6):
        now[0] += t.locked("b") + 0.001
        assert t.locked("b") == 0
        locks.append(t.failed("b"))
    assert locks == [120, 240, 480, 900, 900, 900]
    # A quiet hour, or a successful sign-in, starts the address afresh.
    now[0] += 900 + throttle.FORGET_AFTER + 1
    assert t.locked("b") == 0 and t.failed("b") == 0
    t.succeeded("b")
    assert len([a for a in ("a", "b") if a in t._addresses]) == 1


def test_the_throttle_stays_bounded_whatever_addresses_come(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """30,000 addresses, each failing five times: at most MAX_ADDRESSES are remembered, the
    memory stops growing once the table is full (over a whole table's worth of new addresses
    after it turned over once), and the log holds a minute's allowance of lines and one that
    says how many were left out."""
    caplog.set_level("DEBUG", logger="worker.console")
    now = [0.0]
    t = throttle.SignInThrottle(clock=lambda: now[0])

    def attack(first: int, last: int) -> None:
        for i in range(first, last):
            address = f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
            for _ in range(5):
                t.locked(address)
                t.failed(address)
            now[0] += 0.0001

    tracemalloc.start()
    try:
        attack(0, 2 * throttle.MAX_ADDRESSES)  # the table full, and turned over once
        full = tracemalloc.get_traced_memory()[0]
        more = throttle.MAX_ADDRESSES
        attack(2 * throttle.MAX_ADDRESSES, 3 * throttle.MAX_ADDRESSES)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(t) == throttle.MAX_ADDRESSES and len(t._ends) <= throttle.MAX_ADDRESSES
    # Kept, each of the 10,000 more addresses would cost hundreds of bytes (megabytes in all);
    # bounded, nothing.
    assert after - full < more * 5, (full, after)
    assert t.locked("10.0.117.47") > 0  # the latest address is still locked
    assert len(caplog.records) == throttle.LOG_LINES
    now[0] += 61
    t.failed("192.0.2.1")
    assert "more such lines left out in the last minute" in caplog.records[-1].getMessage()


# -- oversized values ------------------------------------------------------------------------------


FIRST_MD5 = "c4ca4238a0b923820dcc509a6f75849b"  # md5('1'), where the big payload starts


def _medians(server: MetricsServer, *paths: str, n: int = 9) -> list[float]:
    """The median time of ``n`` views of each path, the views taken in turns (so that a moment
    of load on the machine weighs on each alike), after one view each to warm up."""
    times: list[list[float]] = [[] for _ in paths]
    for round in range(n + 1):
        for i, path in enumerate(paths):
            start = time.perf_counter()
            status, _, _ = request(server, "GET", path)
            if round:
                times[i].append(time.perf_counter() - start)
            assert status == 200, path
    return [sorted(t)[n // 2] for t in times]


def _download(server: MetricsServer, path: str) -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("GET", path, headers={"Accept-Encoding": "gzip"})
    r = c.getresponse()
    body = r.read()
    got = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, got, body


def test_an_oversized_payload_is_cut_on_its_page_and_downloaded_whole(
    armed: MetricsServer, schema: str, conn: psycopg.Connection
) -> None:
    """A 50 MB payload written by SQL: its page reads none of it, so it is no slower than the
    page of a small payload (medians, at most 3 times), says how large it is as stored, and
    links to a download that returns the payload's JSON byte for byte, as an attachment with
    the console's headers. A 2 MB payload (small once compressed) shows its first 65,536
    characters, its size, and the same link; a result is shown the same way."""
    small, big, mid = (
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, payload) VALUES ('t', %s) RETURNING id", (p,)
        ).fetchone()[0]  # type: ignore[index]
        for p in ('{"to": "a@example.com"}', "{}", "{}")
    )
    conn.execute(
        f"UPDATE {schema}.tasks SET payload = jsonb_build_object('rows', (SELECT"
        " string_agg(md5(g::text), '') FROM generate_series(1, 1600000) AS g),"
        " 'note', E'\u00e9t\u00e9 \"quoted\" \\n <b>') WHERE id = %s",
        (big,),
    )
    conn.execute(
        f"UPDATE {schema}.tasks SET payload = jsonb_build_object('blob', repeat('p', 2000000)),"
        " state = 'done', finished_at = now(),"
        " result = jsonb_build_object('r', repeat('r', 100000)) WHERE id = %s",
        (mid,),
    )
    conn.execute(  # an error history of 4 MB that does not compress
        f"UPDATE {schema}.tasks SET errors = (SELECT jsonb_agg(jsonb_build_object('attempt', g,"
        " 'error', (SELECT string_agg(md5((g * 1000 + h)::text), '') FROM generate_series(1, 30)"
        " AS h))) FROM generate_series(1, 4000) AS g) WHERE id = %s",
        (big,),
    )
    size = conn.execute(
        f"SELECT octet_length(payload::text) FROM {schema}.tasks WHERE id = %s", (big,)
    ).fetchone()[0]  # type: ignore[index]
    assert size > 50_000_000
    baseline, took = _medians(armed, f"/console/jobs/{small}", f"/console/jobs/{big}")
    assert took <= 3 * baseline, (took, baseline)
    page = request(armed, "GET", f"/console/jobs/{big}")[2]
    # The job browser lists it as fast, without its payload.
    baseline, took = _medians(armed, "/console/jobs?state=done", "/console/jobs?state=queued")
    assert took <= 3 * baseline, (took, baseline)
    listing = request(armed, "GET", "/console/jobs?state=queued")[2]
    assert f'data-task-id="{big}"' in listing and FIRST_MD5 not in listing
    assert len(page) < 50_000 and FIRST_MD5 not in page
    assert "Too large to show here:" in page and "as stored in the database" in page
    assert f'href="/console/jobs/{big}/payload.json"' in page
    assert "The error history is too large to show here" in page
    assert f'href="/console/jobs/{big}/errors.json"' in page
    status, _, body = _download(armed, f"/console/jobs/{big}/errors.json")
    want = conn.execute(
        f"SELECT convert_to(errors::text, 'UTF8') FROM {schema}.tasks WHERE id = %s", (big,)
    ).fetchone()[0]  # type: ignore[index]
    assert status == 200 and body == want and len(json.loads(body)) == 4000

    status, headers, body = _download(armed, f"/console/jobs/{big}/payload.json")
    want = conn.execute(
        f"SELECT convert_to(payload::text, 'UTF8') FROM {schema}.tasks WHERE id = %s", (big,)
    ).fetchone()[0]  # type: ignore[index]
    assert status == 200 and body == want and len(body) > 50_000_000
    json.loads(body)
    assert headers["content-type"] == "application/json"
    assert headers["content-disposition"] == f'attachment; filename="task-{big}-payload.json"'
    assert headers["content-length"] == str(len(want))
    assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-store"
    assert "default-src 'none'" in headers["content-security-policy"]

    status, _, page = request(armed, "GET", f"/console/jobs/{mid}")
    assert status == 200 and "p" * 60_000 in page and "p" * 70_000 not in page
    assert "Cut: the first 65,536 characters of 2.0 MB of JSON" in page
    assert "r" * 60_000 in page and f'href="/console/jobs/{mid}/result.json"' in page
    for what, column in (("payload", "payload"), ("result", "result")):
        status, _, body = _download(armed, f"/console/jobs/{mid}/{what}.json")
        want = conn.execute(
            f"SELECT convert_to({column}::text, 'UTF8') FROM {schema}.tasks WHERE id = %s", (mid,)
        ).fetchone()[0]  # type: ignore[index]
        assert status == 200 and body == want
    _, _, page = request(armed, "GET", f"/console/jobs/{small}")
    assert "&quot;to&quot;: &quot;a@example.com&quot;" in page and "23 bytes of JSON" in page
    assert "<h3>Result</h3>" not in page
    for path in (f"/console/jobs/{small}/result.json", "/console/jobs/999999/payload.json"):
        assert request(armed, "GET", path)[0] == 404
    evil = {"Host": "evil.example"}
    status, _, text = request(armed, "GET", f"/console/jobs/{big}/payload.json", headers=evil)
    assert status == 421 and FIRST_MD5 not in text
