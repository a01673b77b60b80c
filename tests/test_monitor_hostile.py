"""Hostile input (issue 10): a producer can write any row with plain SQL, and any client can
connect to the metrics port. The scrape and the page stay small, nothing from the data comes out
raw, and idle, slow or oversized clients neither hold threads nor get past the limits."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import fetch

from worker.errors import ConfigError
from worker.monitor.bounds import OTHER, QueueRow, clip, exported, label
from worker.monitor.hosts import split_host
from worker.monitor.server import MetricsServer, serve
from worker.tasks.registry import Registry

QUEUES = 20_000
BIG_NAME = 5_000_000


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.fixture
def hostile(schema: str, conn: psycopg.Connection) -> Iterator[str]:
    s = schema
    # Rows from before migration 0004, which refuses names over 255 characters at the insert:
    # the monitor must stay bounded with such rows in the table too.
    conn.execute(f"ALTER TABLE {s}.tasks DROP CONSTRAINT tasks_task_length")
    conn.execute(  # 20,000 queue names of one task each
        f"INSERT INTO {s}.tasks (task, queue) SELECT 'spam', 'spam-' || g"
        f" FROM generate_series(1, {QUEUES}) AS g"
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue) SELECT 'mail.send', 'heavy'"
        " FROM generate_series(1, 300)"
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue) VALUES"
        " ('<script>alert(1)</script>', '<script>q</script>'),"
        " (E'\\x1b[31mred\\x1b[0m', E'esc\\x1bq'), ('mine', 'served-small')"
    )
    conn.execute(  # an unknown task with a 5 MB name, failed with a 1 MB error
        f"INSERT INTO {s}.tasks (task, queue, state, attempts, finished_at, last_error)"
        f" VALUES (repeat('x', {BIG_NAME}), 'emails', 'failed', 1, now(),"
        " 'unknown task <script>alert(2)</script> ' || repeat('E', 1000000))"
    )
    conn.execute(  # a live worker, registered the way queries/workers.sql does it
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency)"
        " VALUES (gen_random_uuid(), 'box-1', 4242, ARRAY['served-small', 'served-empty'], 4)"
    )
    conn.execute(  # a stopped one: its queue gets no special treatment
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency, stopped_at)"
        " VALUES (gen_random_uuid(), 'box-2', 1, ARRAY['stopped-queue'], 4, now())"
    )
    yield s


@pytest.fixture
def hostile_server(pg_dsn: str, hostile: str) -> Iterator[MetricsServer]:
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=hostile, ttl=0)
    yield server
    server.stop()


def test_hostile_rows_keep_the_scrape_small(
    hostile_server: MetricsServer, hostile: str, conn: psycopg.Connection
) -> None:
    status, text = fetch(hostile_server.url + "metrics")
    assert status == 200
    assert len(text.encode()) < 256 * 1024
    m = families(text)
    queued = {lbl["queue"]: v for lbl, v in m["worker_queue_tasks"] if lbl["state"] == "queued"}
    assert OTHER in queued
    # Served queues individually, however small; the large one; no more than 50 others.
    assert queued["served-small"] == 1 and queued["served-empty"] == 0
    assert queued["heavy"] == 300
    assert "stopped-queue" not in queued
    assert len(queued) <= 2 + 50 + 1
    # Nothing is lost: the aggregate plus the rest add up to the table.
    total = conn.execute(f"SELECT count(*) FROM {hostile}.tasks WHERE state = 'queued'").fetchone()[
        0
    ]
    assert sum(queued.values()) == total
    (truncated,) = [v for _, v in m["worker_queue_names_truncated"]]
    assert truncated == 1.0  # 20,000 names: past the scan limit
    (in_other,) = [v for _, v in m["worker_queues_in_other"]]
    assert in_other > 1000
    assert "\x1b" not in text  # control bytes made visible
    assert any(q.startswith("esc\\x1b") for q in queued)


def test_hostile_rows_keep_the_page_small_and_escaped(hostile_server: MetricsServer) -> None:
    status, body = fetch(hostile_server.url)
    assert status == 200
    assert len(body.encode()) < 512 * 1024
    assert "<script" not in body.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body or "&lt;script&gt;q" in body
    assert "\x1b" not in body and "esc\\x1bq" in body  # control bytes made visible
    assert "x" * (BIG_NAME // 1000) not in body
    assert f"… [{BIG_NAME - 200:,} more characters]" in body  # the 5 MB name, cut
    assert "more characters]" in body and "E" * 5000 not in body  # the 1 MB error, cut
    # A hundred queues a page, the count of the rest, links to move on.
    assert len(re.findall(r'<tr data-queue="', body)) == 100
    assert "queues 1 to 100 of" in body and "queues on other pages" in body
    assert 'href="?queues_page=2#queues"' in body and "queues_page=0" not in body
    assert "Too many queue names to list" in body
    status, second = fetch(hostile_server.url + "?queues_page=2")
    assert status == 200 and "queues 101 to 200 of" in second
    assert 'href="?queues_page=1#queues"' in second and 'href="?queues_page=3#queues"' in second
    first_rows = set(re.findall(r'<tr data-queue="([^"]*)"', body))
    assert first_rows.isdisjoint(re.findall(r'<tr data-queue="([^"]*)"', second))
    for junk in ("?queues_page=-5", "?queues_page=abc", "?queues_page=99999999"):
        status, page = fetch(hostile_server.url + junk)
        assert status == 200 and len(re.findall(r'<tr data-queue="', page)) >= 1


def test_scan_and_page_costs_are_measured_small(hostile_server: MetricsServer) -> None:
    """The statistics stop at the scan limit: well under the statement timeout."""
    fetch(hostile_server.url + "metrics")
    snap = hostile_server.db.queue_snapshot()
    assert snap.error is None and snap.rest is not None
    assert len(snap.queues) <= hostile_server.db.max_queues + 10
    assert snap.duration < 3.0


def test_a_real_workers_queue_is_exported_however_small(
    pg_dsn: str, schema: str, conn: psycopg.Connection, thread_worker: Callable[..., Any]
) -> None:
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'spam', 'spam-' || g"
        " FROM generate_series(1, 200) AS g"
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'spam', 'spam-big'"
        " FROM generate_series(1, 100)"
    )
    tasks = Registry()
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0)
    try:
        with thread_worker(tasks, queues=["tiny-served"]):
            deadline = time.monotonic() + 20
            while True:
                _, text = fetch(server.url + "metrics")
                if 'worker_queue_tasks{queue="tiny-served",state="queued"} 0.0' in text:
                    break
                assert time.monotonic() < deadline, text[-2000:]
                time.sleep(0.2)
            assert 'queue="spam-big"' in text and f'queue="{OTHER}"' in text
            # At most 50 of the unserved queues get series of their own (one per state each).
            spam = re.findall(r'worker_queue_tasks\{queue="spam-[^"]*",state="queued"\}', text)
            assert 0 < len(spam) <= 50
    finally:
        server.stop()


# -- the selection, without a database -------------------------------------------------------


def test_exported_keeps_served_and_largest_and_sums_the_rest() -> None:
    rows = [QueueRow(f"q{i}", i, 0, 0, False, float(i)) for i in range(200)]
    rows += [QueueRow("served", 0, 0, 0, False, None, served=True)]
    rows += [QueueRow(OTHER, 1000, 1, 0, True, 5.0)]  # a producer's queue named like the sum
    rest = QueueRow("q99", 7, 2, 0, False, None)
    shown = exported(rows, rest, top=50)
    names = [q.queue for q in shown.queues]
    assert "served" in names and OTHER not in names and len(names) == 51
    assert {f"q{i}" for i in range(150, 200)} <= set(names)
    assert shown.other.queued == sum(range(150)) + 1000 + 7
    assert shown.other.capped and shown.other.oldest_seconds == 149.0
    assert shown.other_count == 151


def test_names_are_cut_visibly_and_labels_stay_unique() -> None:
    assert clip("a" * 500) == "a" * 200 + "… [300 more characters]"
    assert clip("ab", length=1000) == "ab… [998 more characters]"  # cut by the SQL already
    assert clip("ab", length=2) == "ab"
    assert clip("x" * 300, length=1000).endswith("[800 more characters]")
    assert clip("a\x1bb\x00\x9b\n") == "a\\x1bb\\x00\\x9b\n"
    long_a, long_b = "q" * 300 + "a", "q" * 300 + "b"
    assert len(label(long_a)) <= 120 and label(long_a) != label(long_b)
    assert label("plain") == "plain"


# -- the HTTP server -------------------------------------------------------------------------


@pytest.fixture
def http_server(pg_dsn: str, schema: str) -> Iterator[MetricsServer]:
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0, request_timeout=2.0, threads=4)
    yield server
    server.stop()


def connect(server: MetricsServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def headers_of(raw: bytes) -> tuple[int, dict[str, str]]:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    return status, {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}


def assert_secure(headers: dict[str, str]) -> None:
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["cache-control"] == "no-store"
    assert "default-src 'none'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY"
    assert headers["referrer-policy"] == "no-referrer"


def raw_request(server: MetricsServer, data: bytes) -> bytes:
    with connect(server) as s:
        s.sendall(data)
        return read_all(s)


def test_idle_sockets_hold_no_thread_and_are_closed(http_server: MetricsServer) -> None:
    before = threading.active_count()
    idle = [connect(http_server) for _ in range(200)]
    try:
        time.sleep(0.3)
        start = time.monotonic()
        assert fetch(http_server.url + "healthz", timeout=2) == (200, "ok\n")
        assert time.monotonic() - start < 1.0
        status, text = fetch(http_server.url + "metrics", timeout=5)
        assert status == 200 and "worker_database_up" in text
        assert threading.active_count() <= before + 4  # the loop runs already; 4 threads
        # Every idle socket is told 408 and closed once the 2 s request timeout has passed.
        start = time.monotonic()
        for s in idle:
            raw = read_all(s, timeout=5)
            assert raw.startswith(b"HTTP/1.1 408"), raw[:100]
        assert time.monotonic() - start < 2.0 + 1.5
    finally:
        for s in idle:
            s.close()


def test_a_slowloris_is_cut_off(http_server: MetricsServer) -> None:
    with connect(http_server) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < 6:
            try:
                s.sendall(b"X")  # one header byte every 0.2 s, never a complete head
            except OSError:
                closed = True
                break
            s.settimeout(0.2)
            try:
                if s.recv(4096) is not None:
                    closed = True
                    break
            except TimeoutError:
                pass
        assert closed and time.monotonic() - start < 2.0 + 1.5


def test_connections_past_the_cap_get_a_fast_503_with_the_headers(pg_dsn: str, schema: str) -> None:
    server = serve(
        "127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0, max_connections=4, request_timeout=30
    )
    try:
        first = connect(server)
        others = [connect(server) for _ in range(3)]
        time.sleep(0.2)
        newest = connect(server)  # pushes out the oldest waiting connection
        raw = read_all(first, timeout=3)
        status, headers = headers_of(raw)
        assert status == 503
        assert_secure(headers)
        newest.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_all(newest).startswith(b"HTTP/1.1 200")
        for s in (first, newest, *others):
            s.close()
    finally:
        server.stop()


def test_error_responses_carry_the_security_headers(http_server: MetricsServer) -> None:
    for path in ("nope", "healthz", "metrics"):
        req = urllib.request.Request(http_server.url + path)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                assert_secure({k.lower(): v for k, v in r.headers.items()})
        except urllib.error.HTTPError as exc:
            assert exc.code == 404 and path == "nope"
            assert_secure({k.lower(): v for k, v in exc.headers.items()})

    def boom() -> None:
        raise RuntimeError("boom")

    http_server.db.page = boom  # type: ignore[method-assign]
    host = f"127.0.0.1:{http_server.port}".encode()
    page = b"GET / HTTP/1.1\r\nHost: " + host + b"\r\n\r\n"
    status, headers = headers_of(raw_request(http_server, page))
    assert status == 500
    assert_secure(headers)
    # A foreign Host is refused before anything is read, with the same headers.
    status, headers = headers_of(raw_request(http_server, page.replace(host, b"x")))
    assert status == 421
    assert_secure(headers)
    cases = {
        b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n": 414,
        b"GET / HTTP/1.1\r\n" + b"X-Big: " + b"b" * 20_000 + b"\r\n\r\n": 431,
        b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(2000)) + b"\r\n": 431,
        b"BOGUS\r\n\r\n": 400,
        b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n": 501,
    }
    for request, want in cases.items():
        raw = raw_request(http_server, request)
        status, headers = headers_of(raw)
        assert status == want, raw[:200]
        assert_secure(headers)


# -- the Host header (DNS rebinding) ---------------------------------------------------------------


def _get(server: MetricsServer, path: str, host: str | None, method: str = "GET") -> int:
    """The status of a request to ``path`` naming ``host`` (None: no Host header at all)."""
    line = f"{method} {path} HTTP/1.1\r\n" + (f"Host: {host}\r\n" if host is not None else "")
    extra = ""
    if method == "POST":
        body = "token=console-token-for-hosts-0123&name=x"
        extra = (
            f"Origin: http://{host}\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}"
        )
    status, headers = headers_of(raw_request(server, (line + (extra or "\r\n")).encode()))
    assert headers["x-content-type-options"] == "nosniff"
    return status


PAGES = ("/", "/index.html", "/console/", "/console/jobs", "/console/login", "/console/queues")
PAGES += ("/console/static/console.js", "/console/jobs/1")


def test_the_page_and_the_console_answer_only_their_own_host_names(
    pg_dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A DNS-rebinding page's requests name its own host: refused (421) on every page and on a
    sign-in; the server's address with its port, and localhost on any port (a tunnel), are
    answered; /metrics, /healthz and /readyz answer any Host."""
    caplog.set_level("INFO")
    token = "console-token-for-hosts-0123"
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0, console_token=token)
    port = server.port
    try:
        foreign = [
            "evil.example",
            f"evil.example:{port}",
            f"127.0.0.1.evil.example:{port}",
            f"localhost.evil.example:{port}",
            f"evil.example:{port}@127.0.0.1",
            "",
            None,
        ]
        own = [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost:8080"]
        own += [f"LOCALHOST:{port}", f"localhost.:{port}", "127.0.0.1:1"]
        for path in PAGES:
            for host in foreign:
                assert _get(server, path, host) == 421, (path, host)
            for host in own:
                assert _get(server, path, host) in (200, 404), (path, host)
        for path in ("/metrics", "/healthz", "/readyz"):
            for host in foreign:
                assert _get(server, path, host) == 200, (path, host)
        # Two Host headers, one of them ours: which one a proxy or a cache reads is a guess.
        own_host = f"127.0.0.1:{port}"
        twice = f"GET / HTTP/1.1\r\nHost: {own_host}\r\nHost: evil.example\r\n\r\n".encode()
        assert headers_of(raw_request(server, twice))[0] == 421
        # A sign-in sent under the foreign name (its Origin matches its Host) is refused too.
        assert _get(server, "/console/login", f"evil.example:{port}", "POST") == 421
        assert _get(server, "/console/login", f"127.0.0.1:{port}", "POST") == 303
    finally:
        server.stop()
    refused = [r.getMessage() for r in caplog.records if "refused a request for Host" in r.msg]
    assert len(refused) <= len(foreign) + 1  # one line per name, not per request
    started = [r.getMessage() for r in caplog.records if "answer requests for Host" in r.msg]
    assert started and f"127.0.0.1:{port}" in started[0] and "localhost (any port)" in started[0]


def test_configured_host_names_are_answered(pg_dsn: str, schema: str) -> None:
    names = ["Console.Example.com", "ops.example:8443"]
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0, console_hosts=names)
    try:
        for host in ("console.example.com", "console.example.com:443", "ops.example:8443"):
            assert _get(server, "/console/", host) == 200, host
        for host in ("ops.example:9999", "ops.example", "example.com", "evil.console.example.com"):
            assert _get(server, "/console/", host) == 421, host
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="--console-host"):
        serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, console_hosts=["bad name/x"])


def test_bound_to_every_address_the_machines_names_are_answered(pg_dsn: str, schema: str) -> None:
    """Bound to 0.0.0.0 without configured names: the machine's host name and the addresses it
    resolves to, with the port, besides localhost; a configured name replaces the host name."""
    hostname = socket.gethostname()
    addresses = {a[4][0] for a in socket.getaddrinfo(hostname, None, socket.AF_INET)}
    server = serve("0.0.0.0", 0, dsn=pg_dsn, schema=schema, ttl=0)
    try:
        port = server.port
        for host in [f"{hostname}:{port}", *(f"{a}:{port}" for a in addresses), "localhost:1"]:
            assert _get(server, "/", host) == 200, host
        assert _get(server, "/", f"{hostname}:{port + 1 if port < 65535 else 1}") == 421
        assert _get(server, "/", f"evil.example:{port}") == 421
    finally:
        server.stop()
    server = serve("0.0.0.0", 0, dsn=pg_dsn, schema=schema, ttl=0, console_hosts=["ops.example"])
    try:
        assert _get(server, "/", "ops.example") == 200
        if hostname not in ("localhost", *addresses):
            assert _get(server, "/", f"{hostname}:{server.port}") == 421
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("Example.COM", ("example.com", None)),
        ("example.com.:80", ("example.com", 80)),
        ("[::1]:9187", ("::1", 9187)),
        ("::1", ("::1", None)),
        ("10.0.0.7:1", ("10.0.0.7", 1)),
        ("a b", None),
        ("x:0", None),
        ("x:65536", None),
        ("x:+80", None),
        ("[::1]x", None),
        ("user@host", None),
        ("a..b", None),
        ("", None),
        ("é.example", None),
    ],
)
def test_host_headers_are_read_strictly(text: str, parsed: Any) -> None:
    assert split_host(text) == parsed
