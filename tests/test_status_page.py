"""The status page: what it shows must match the table, everything from the database must come
out escaped, no password may appear, and it must render in a real (headless) browser."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import psycopg
import pytest
from conftest import wait_until
from test_metrics import fetch

from worker.monitor.server import MetricsServer, serve

XSS_TASK = "<img src=x onerror=\"document.title='pwned'\">"
XSS_ERROR = (
    "ValueError: <script>document.title='pwned'</script><b id=\"xss\">boom</b>\n"
    '  File "handlers.py", line 3, in <module>\n    raise ValueError(x)'
)
XSS_QUEUE = 'q<i id="xssq">'


class Cells(HTMLParser):
    """Collects the queue table's cells ({queue: {column: text}}) and every element id/tag."""

    def __init__(self) -> None:
        super().__init__()
        self.queues: dict[str, dict[str, str]] = {}
        self.ids: set[str] = set()
        self.tags: list[str] = []
        self.title = ""
        self._queue: str | None = None
        self._col: str | None = None
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "tr" and "data-queue" in a:
            self._queue = str(a["data-queue"])
            self.queues[self._queue] = {}
        if tag == "td" and self._queue is not None and "data-col" in a:
            self._col = str(a["data-col"])
        if tag == "title":
            self._in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._col = None
        if tag == "tr":
            self._queue = None
        if tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._queue is not None and self._col is not None:
            self.queues[self._queue][self._col] = (
                self.queues[self._queue].get(self._col, "") + data
            ).strip()
        if self._in_title:
            self.title += data


def parse(html_text: str) -> Cells:
    p = Cells()
    p.feed(html_text)
    return p


@pytest.fixture
def populated(schema: str, conn: psycopg.Connection) -> Iterator[str]:
    """A schema with tasks in several states and queues, a hostile task, a worker, a cron
    schedule, a lock row and an advisory lock held by another session."""
    s = schema
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue) SELECT 'mail.send', 'emails'"
        " FROM generate_series(1, 5)"
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, state, finished_at) SELECT 'mail.send',"
        " 'emails', 'done', now() FROM generate_series(1, 2)"
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, run_at) SELECT 'report.build', 'reports',"
        " now() + interval '1 hour' FROM generate_series(1, 3)"
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, state, attempts, finished_at, last_error)"
        " VALUES (%s, %s, 'failed', 5, now(), %s)",
        (XSS_TASK, XSS_QUEUE, XSS_ERROR),
    )
    conn.execute(
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency, in_flight)"
        " VALUES (gen_random_uuid(), 'box-1', 4242, ARRAY['emails', 'reports'], 10, 3)"
    )
    if conn.execute("SELECT to_regclass(%s)", (f"{s}.cron_schedules",)).fetchone()[0]:
        conn.execute(
            f"INSERT INTO {s}.cron_schedules (key, expr, task) VALUES"
            " ('nightly-report', '0 3 * * *', 'report.build')"
        )
    if conn.execute("SELECT to_regclass(%s)", (f"{s}.locks",)).fetchone()[0]:
        conn.execute(
            f"INSERT INTO {s}.locks (name, holder, expires_at) VALUES"
            " ('invoice-sync', 'box-1:4242:abc', now() + interval '1 minute')"
        )
    yield s


@pytest.fixture
def page_server(pg_dsn: str, populated: str) -> Iterator[MetricsServer]:
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=populated, ttl=0)
    yield server
    server.stop()


def counts(conn: psycopg.Connection, schema: str, queue: str) -> dict[str, int]:
    rows = conn.execute(
        f"SELECT state::text, count(*) FROM {schema}.tasks WHERE queue = %s GROUP BY 1", (queue,)
    ).fetchall()
    return dict(rows)


def test_page_shows_queues_workers_failures_cron_and_locks(
    page_server: MetricsServer, populated: str, conn: psycopg.Connection, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(4242, 77)")
        status, body = fetch(page_server.url)
    assert status == 200
    page = parse(body)
    emails = counts(conn, populated, "emails")
    assert page.queues["emails"]["queued"] == str(emails["queued"])
    assert page.queues["emails"]["done"] == str(emails["done"])
    assert page.queues["emails"]["failed"] == "0"
    # Delayed rows wait as 'scheduled' (schema/0006): none of them is queued yet.
    assert page.queues["reports"]["queued"] == "0"
    assert page.queues["reports"]["scheduled"] == "3"
    assert page.queues[XSS_QUEUE]["failed"] == "1"  # the parser unescaped the attribute
    assert "box-1" in body and "4242" in body  # the worker row
    assert "nightly-report" in body and "0 3 * * *" in body
    assert "invoice-sync" in body
    assert "(4242, 77)" in body  # the advisory lock another session holds


def test_everything_from_the_database_is_escaped(page_server: MetricsServer) -> None:
    status, body = fetch(page_server.url)
    assert status == 200
    page = parse(body)
    assert "xss" not in page.ids and "xssq" not in page.ids
    assert "<script>document" not in body and "<img src=x" not in body
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in body
    assert "&lt;img src=x onerror=" in body
    assert page.tags.count("script") == 0


def test_no_password_on_the_page_or_in_readiness(pg_dsn: str, populated: str) -> None:
    """The embedded server trusts local connections, so a DSN with a password still works."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(pg_dsn)
    with_secret = make_conninfo(**{**params, "password": "s3cr3t-pw"})
    server = serve("127.0.0.1", 0, dsn=with_secret, schema=populated, ttl=0)
    try:
        status, body = fetch(server.url)
        assert status == 200 and "s3cr3t-pw" not in body and "***" in body
    finally:
        server.stop()
    # A database that cannot be reached: the error is on the page, the password is not.
    down = make_conninfo(host="127.0.0.1", port="1", user="u", password="s3cr3t-pw", dbname="x")
    server = serve("127.0.0.1", 0, dsn=down, schema=populated, ttl=0)
    try:
        status, body = fetch(server.url)
        assert status == 503 and "database problem" in body and "s3cr3t-pw" not in body
        status, body = fetch(server.url + "readyz")
        assert status == 503 and "s3cr3t-pw" not in body
        status, body = fetch(server.url + "metrics")
        assert status == 200 and "worker_database_up 0.0" in body
    finally:
        server.stop()


def test_page_works_without_the_cron_and_lock_tables(
    pg_dsn: str, populated: str, conn: psycopg.Connection
) -> None:
    conn.execute(f"DROP TABLE IF EXISTS {populated}.cron_schedules, {populated}.locks")
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=populated, ttl=0)
    try:
        status, body = fetch(server.url)
    finally:
        server.stop()
    assert status == 200
    assert f"No <code>{populated}.cron_schedules</code> table" in body
    assert f"No <code>{populated}.locks</code> table" in body
    assert parse(body).queues["emails"]["queued"] == "5"


def test_page_headers_forbid_scripts(page_server: MetricsServer) -> None:
    import urllib.request

    with urllib.request.urlopen(page_server.url) as r:
        csp = r.headers["Content-Security-Policy"]
        assert r.headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in csp and "script-src" not in csp


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.skipif(
    _chromium() is None,
    reason="chromium is not installed (apt-get install -y chromium) - the page is still checked "
    "as HTML by the other tests in this file",
)
def test_page_renders_in_headless_chromium(
    page_server: MetricsServer, populated: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """The DOM a real browser builds: queue counts present, the hostile strings shown as text
    (no element they tried to inject exists, the title is untouched), and a screenshot."""
    binary = _chromium()
    assert binary
    r = _run_chromium(binary, tmp_path / "profile", "--dump-dom", page_server.url)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = parse(r.stdout)
    assert dom.title.startswith("worker status")
    assert dom.queues["emails"]["queued"] == str(counts(conn, populated, "emails")["queued"])
    assert dom.queues["reports"]["scheduled"] == "3"
    assert dom.queues[XSS_QUEUE]["failed"] == "1"
    assert "xss" not in dom.ids and "xssq" not in dom.ids
    assert "pwned" not in dom.title
    assert dom.tags.count("img") == 0 and dom.tags.count("script") == 0
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in r.stdout

    shot = tmp_path / "status.png"
    r = _run_chromium(
        binary,
        tmp_path / "profile2",
        "--window-size=1280,1600",
        f"--screenshot={shot}",
        page_server.url,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    wait_until(lambda: shot.exists() and shot.stat().st_size > 10_000, timeout=10)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
