"""The operator console in a real browser (Debian's chromium, driven by Playwright through its
executable path; no browser is downloaded): every page loads and shows the table's numbers,
filtering and opening a job work, each action works with the token and is impossible without it,
a forged POST changes nothing, the overview refreshes itself, and with JavaScript off the pages
are still there. Screenshots go to the test's tmp_path."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import wait_until

from worker.monitor.server import MetricsServer, serve

TOKEN = "console-token-for-the-tests-0123456789"
XSS_TASK = "<img src=x onerror=\"document.title='pwned'\">"
XSS_ERROR = "ValueError: <script>document.title='pwned'</script><b id=\"xss\">boom</b>"
XSS_QUEUE = 'q<i id="xssq">'
REBIND = "rebind.example"


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


try:
    from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None  # type: ignore[assignment]

pytestmark = pytest.mark.skipif(
    _chromium() is None or sync_playwright is None,
    reason="needs chromium (apt-get install -y chromium) and playwright (pip install -e "
    "'.[test]'); the console's HTTP side is still tested by test_console_http.py",
)


@pytest.fixture(scope="module")
def playwright_browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        # REBIND resolves to this machine, as an attacker's name does once DNS-rebound; and the
        # browser lets a page of another site reach a local address, as browsers without
        # Chromium's local network checks (Firefox, Safari) do: the server must refuse by itself.
        args = [
            "--no-sandbox",
            f"--host-resolver-rules=MAP {REBIND} 127.0.0.1",
            "--disable-features=BlockInsecurePrivateNetworkRequests,"
            "PrivateNetworkAccessSendPreflights,LocalNetworkAccessChecks",
        ]
        b = p.chromium.launch(executable_path=_chromium(), args=args)
        yield b
        b.close()


class Contexts:
    """Browser contexts (each its own cookies) that wait 10 s at most for anything, closed at the
    end of the test."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.opened: list[BrowserContext] = []

    def new_context(self, **options: Any) -> BrowserContext:
        context = self.browser.new_context(**options)
        context.set_default_timeout(10_000)
        self.opened.append(context)
        return context

    def new_page(self, **options: Any) -> Page:
        return self.new_context(**options).new_page()


@pytest.fixture
def browser(playwright_browser: Browser) -> Iterator[Contexts]:
    contexts = Contexts(playwright_browser)
    yield contexts
    for context in contexts.opened:
        context.close()


@pytest.fixture
def rows(schema: str, conn: psycopg.Connection) -> dict[str, Any]:
    """Tasks in every state the actions apply to, a hostile failed one, and a worker."""
    s = schema

    def insert(sql: str, *params: Any) -> int:
        row = conn.execute(f"INSERT INTO {s}.tasks {sql} RETURNING id", params).fetchone()
        assert row is not None
        return int(row[0])

    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, payload) SELECT 'mail.send', 'emails',"
        " jsonb_build_object('to', 'user' || g || '@example.com') FROM generate_series(1, 5) g"
    )
    ids = {
        "failed": insert(
            "(task, queue, state, attempts, finished_at, last_error, payload) VALUES"
            " ('report.build', 'reports', 'failed', 3, now(), 'KeyError: missing column', "
            ' \'{"report": "quarterly-needle"}\')'
        ),
        "queued": insert("(task, queue) VALUES ('report.build', 'reports')"),
        "done": insert(
            "(task, queue, state, finished_at) VALUES ('report.build', 'reports', 'done', now())"
        ),
        "hostile": insert(
            "(task, queue, state, attempts, finished_at, last_error) VALUES"
            " (%s, %s, 'failed', 5, now(), %s)",
            XSS_TASK,
            XSS_QUEUE,
            XSS_ERROR,
        ),
    }
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, state, attempts, finished_at, last_error)"
        " SELECT 'bulk.job', 'bulk', 'failed', 1, now(), 'TimeoutError' FROM generate_series(1, 7)"
    )
    conn.execute(
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency)"
        " VALUES (gen_random_uuid(), 'box-7', 4242, ARRAY['emails', 'reports'], 8)"
    )
    return ids


def _serve(pg_dsn: str, schema: str, token: str | None) -> MetricsServer:
    return serve(
        "127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0, console_token=token, console_refresh=1.0
    )


@pytest.fixture
def readonly(pg_dsn: str, schema: str, rows: dict[str, Any]) -> Iterator[MetricsServer]:
    server = _serve(pg_dsn, schema, None)
    yield server
    server.stop()


@pytest.fixture
def armed(pg_dsn: str, schema: str, rows: dict[str, Any]) -> Iterator[MetricsServer]:
    server = _serve(pg_dsn, schema, TOKEN)
    yield server
    server.stop()


def state(conn: psycopg.Connection, schema: str, task_id: int) -> str | None:
    row = conn.execute(
        f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,)
    ).fetchone()
    return row[0] if row else None


def snapshot(conn: psycopg.Connection, schema: str) -> tuple[Any, ...]:
    """Everything an action could change."""
    return (
        conn.execute(f"SELECT id, state::text FROM {schema}.tasks ORDER BY id").fetchall(),
        conn.execute(f"SELECT queue FROM {schema}.paused_queues ORDER BY 1").fetchall(),
        conn.execute(f"SELECT count(*) FROM {schema}.actions").fetchall(),
    )


def sign_in(page: Page, server: MetricsServer, name: str = "alice") -> None:
    page.goto(server.url + "console/login")
    page.fill("input[name=token]", TOKEN)
    page.fill("input[name=name]", name)
    page.click("form.signin button")
    page.wait_for_url(server.url + "console/")
    assert f"signed in as {name}" in page.inner_text("header")


def shot(page: Page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


ACTIONS = [
    ("console/jobs/{failed}/retry", {}),
    ("console/jobs/{queued}/cancel", {}),
    ("console/jobs/{done}/delete", {}),
    ("console/jobs/bulk", {"action": "retry", "state": "failed"}),
    ("console/queues/pause", {"queue": "emails"}),
    ("console/queues/resume", {"queue": "emails"}),
]


def test_read_only_pages_show_the_table_and_offer_no_action(
    browser: Contexts,
    readonly: MetricsServer,
    schema: str,
    conn: psycopg.Connection,
    rows: dict[str, Any],
    tmp_path: Path,
) -> None:
    page = browser.new_page()
    page.goto(readonly.url + "console/")
    assert page.title().startswith("Overview · worker console")
    assert "Read-only console: actions are off" in page.inner_text("main")
    emails = page.locator('tr[data-queue="emails"] td[data-col="queued"]')
    assert emails.inner_text() == "5"
    assert page.locator(f"tr[data-queue='{XSS_QUEUE}'] td[data-col=failed]").inner_text() == "1"
    assert "box-7" in page.inner_text("#live-workers")
    # The hostile strings are text: nothing they tried to inject exists, the title is intact.
    assert page.locator("#xss, #xssq").count() == 0 and "pwned" not in page.title()
    assert "<script>document.title" in page.inner_text("#live-failed")
    shot(page, tmp_path, "overview-read-only")
    for path, heading in (
        ("console/jobs", "Jobs"),
        (f"console/jobs/{rows['failed']}", f"Task {rows['failed']}"),
        (f"console/jobs/{rows['hostile']}", f"Task {rows['hostile']}"),
        ("console/queues", "Queues"),
        ("console/cron", "Cron"),
        ("console/locks", "Locks"),
    ):
        response = page.goto(readonly.url + path)
        assert response is not None and response.status == 200, path
        assert page.locator("main h2").first.inner_text() == heading
        assert page.locator("form[method=post]").count() == 0, path  # no button of any kind
        assert page.locator("#xss, #xssq").count() == 0 and "pwned" not in page.title()
        shot(page, tmp_path, path.replace("/", "-"))
    before = snapshot(conn, schema)
    for path, form in ACTIONS:
        url = readonly.url + path.format(**rows)
        r = page.request.post(url, form=form, headers={"Origin": readonly.url.rstrip("/")})
        assert r.status == 403, path
        assert "actions are off" in r.text()
    assert snapshot(conn, schema) == before


def test_filter_the_browser_and_open_a_job(
    browser: Contexts, readonly: MetricsServer, rows: dict[str, Any], tmp_path: Path
) -> None:
    page = browser.new_page()
    page.goto(readonly.url + "console/jobs")
    assert page.locator("table.jobs tbody tr").count() == 5 + 4 + 7
    page.fill("input[name=queue]", "reports")
    page.select_option("select[name=state]", "failed")
    page.click("form.filter button[type=submit]")
    page.wait_for_url(lambda url: "queue=reports" in url and "state=failed" in url)
    listed = page.locator("table.jobs tbody tr")
    assert listed.count() == 1 and "KeyError: missing column" in listed.inner_text()
    # Text in the payload, on its own.
    page.goto(readonly.url + "console/jobs?text=QUARTERLY-needle")
    assert page.locator("table.jobs tbody tr").count() == 1
    page.click(f'a[href="/console/jobs/{rows["failed"]}"]')
    page.wait_for_url(f"**/console/jobs/{rows['failed']}")
    assert page.inner_text("[data-value=state]") == "failed"
    assert "KeyError: missing column" in page.inner_text("#last-error")
    assert '"report": "quarterly-needle"' in page.inner_text("#payload")
    shot(page, tmp_path, "job")
    # A filter value that cannot be used is named, not a failure.
    page.goto(readonly.url + "console/jobs?id=abc&state=zzz")
    assert "id ignored" in page.inner_text("main") and "state ignored" in page.inner_text("main")


def test_each_action_changes_the_row_once_signed_in(
    browser: Contexts,
    armed: MetricsServer,
    schema: str,
    conn: psycopg.Connection,
    rows: dict[str, Any],
    tmp_path: Path,
) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.goto(armed.url + f"console/jobs/{rows['failed']}")
    assert page.locator("form[method=post] button").count() == 0  # not signed in yet
    assert "sign in" in page.inner_text("header")
    sign_in(page, armed)
    cookie = next(c for c in context.cookies() if c["name"] == "worker_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert TOKEN not in cookie["value"]

    page.goto(armed.url + f"console/jobs/{rows['failed']}")
    page.click("#actions button:text('Retry')")
    assert f"task {rows['failed']} retried" in page.inner_text(".flash")
    assert state(conn, schema, rows["failed"]) == "queued"

    page.goto(armed.url + f"console/jobs/{rows['queued']}")
    page.click("#actions button:text('Cancel')")
    assert f"task {rows['queued']} cancelled" in page.inner_text(".flash")
    assert state(conn, schema, rows["queued"]) == "cancelled"

    page.goto(armed.url + f"console/jobs/{rows['done']}")
    page.click("#actions button:text('Delete')")
    assert f"task {rows['done']} deleted" in page.inner_text(".flash")
    assert state(conn, schema, rows["done"]) is None

    page.goto(armed.url + "console/queues")
    page.click('tr[data-queue="emails"] button:text("Pause")')
    assert "queue emails paused" in page.inner_text(".flash")
    paused = conn.execute(f"SELECT paused_by FROM {schema}.paused_queues WHERE queue = 'emails'")
    assert paused.fetchall() == [("alice",)]
    shot(page, tmp_path, "queues-paused")
    page.click('tr[data-queue="emails"] button:text("Resume")')
    assert "queue emails resumed" in page.inner_text(".flash")
    assert conn.execute(f"SELECT count(*) FROM {schema}.paused_queues").fetchone() == (0,)

    # Bulk, from the browser's filter: a confirmation with the count, then the action.
    page.goto(armed.url + "console/jobs?queue=bulk&state=failed")
    page.click("text=Retry every match…")
    assert page.inner_text("#bulk-found") == "7" and page.inner_text("#bulk-eligible") == "7"
    shot(page, tmp_path, "bulk-confirm")
    page.click("button:text('Retry 7 tasks')")
    assert "retry: 7 of 7 matching task(s) changed" in page.inner_text(".flash")
    counts = conn.execute(
        f"SELECT state::text, count(*) FROM {schema}.tasks WHERE queue = 'bulk' GROUP BY 1"
    ).fetchall()
    assert counts == [("queued", 7)]

    audit = conn.execute(
        f"SELECT actor, address, action, (counts->>'changed')::int FROM {schema}.actions"
        " WHERE source = 'console' ORDER BY id"
    ).fetchall()
    assert audit == [
        ("alice", "127.0.0.1", "retry", 1),
        ("alice", "127.0.0.1", "cancel", 1),
        ("alice", "127.0.0.1", "delete", 1),
        ("alice", "127.0.0.1", "pause", 1),
        ("alice", "127.0.0.1", "resume", 1),
        ("alice", "127.0.0.1", "bulk retry", 7),
    ]
    page.goto(armed.url + "console/")
    assert "bulk retry" in page.inner_text("#live-audit")
    assert TOKEN not in page.content()


def test_a_forged_post_changes_nothing(
    browser: Contexts,
    armed: MetricsServer,
    schema: str,
    conn: psycopg.Connection,
    rows: dict[str, Any],
) -> None:
    context = browser.new_context()
    page = context.new_page()
    sign_in(page, armed)
    page.goto(armed.url + f"console/jobs/{rows['failed']}")
    csrf = page.locator("#actions input[name=csrf]").first.get_attribute("value")
    assert csrf
    origin = armed.url.rstrip("/")
    url = armed.url + f"console/jobs/{rows['failed']}/retry"
    before = snapshot(conn, schema)
    refused = [
        ({}, {"Origin": origin}),  # no CSRF token
        ({"csrf": "x" * len(csrf)}, {"Origin": origin}),  # a wrong one
        ({"csrf": csrf}, {"Origin": "http://evil.example"}),  # another site's page
        ({"csrf": csrf}, {}),  # neither Origin nor Referer
    ]
    for form, headers in refused:
        r = context.request.post(url, form=form, headers=headers, max_redirects=0)
        assert r.status == 403, (form, headers)
    # Another browser (no session cookie) with this session's token.
    stranger = browser.new_context()
    r = stranger.request.post(url, form={"csrf": csrf}, headers={"Origin": origin})
    assert r.status == 403 and "sign in first" in r.text()
    assert snapshot(conn, schema) == before
    # The same request, complete, is accepted: the refusals above were about what was missing.
    r = context.request.post(url, form={"csrf": csrf}, headers={"Origin": origin}, max_redirects=0)
    assert r.status == 303 and state(conn, schema, rows["failed"]) == "queued"
    # A wrong token does not sign in.
    page.goto(armed.url + "console/login")
    page.fill("input[name=token]", TOKEN[:-1] + "X")
    page.click("form.signin button")
    assert "Wrong token." in page.inner_text("main")


def test_the_overview_refreshes_itself_without_reloading(
    browser: Contexts, armed: MetricsServer, schema: str, conn: psycopg.Connection
) -> None:
    page = browser.new_page()
    page.goto(armed.url + "console/")
    cell = page.locator('tr[data-queue="emails"] td[data-col="queued"]')
    assert cell.inner_text() == "5"
    page.evaluate("window.__not_reloaded = true")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'mail.send', 'emails'"
        " FROM generate_series(1, 3)"
    )
    wait_until(lambda: cell.inner_text() == "8", timeout=15, interval=0.2)
    assert page.evaluate("window.__not_reloaded") is True
    assert page.inner_text("#live-status").startswith("live: updated")


def test_with_javascript_off_the_pages_still_show(
    browser: Contexts, armed: MetricsServer, tmp_path: Path
) -> None:
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(armed.url + "console/")
    assert page.inner_text("#live-status") == "reload to refresh"
    assert page.locator('tr[data-queue="emails"] td[data-col="queued"]').inner_text() == "5"
    shot(page, tmp_path, "overview-no-js")
    page.goto(armed.url + "console/jobs?state=failed")
    assert page.locator("table.jobs tbody tr").count() == 1 + 1 + 7


def test_a_rebinding_page_reads_nothing_and_the_console_works_by_name(
    browser: Contexts,
    armed: MetricsServer,
    schema: str,
    conn: psycopg.Connection,
    rows: dict[str, Any],
) -> None:
    """A page of another site, whose name now resolves to this machine (DNS rebinding), fetches
    the console from its own origin: every answer is 421, with no task in it. The same console
    by localhost works as by its address: sign-in, an action, the live refresh."""
    port = armed.port
    context = browser.new_context()
    attacker = context.new_page()
    context.route(
        f"http://{REBIND}:{port}/attack",
        lambda route: route.fulfill(status=200, content_type="text/html", body="<p>hi</p>"),
    )
    attacker.goto(f"http://{REBIND}:{port}/attack")
    for path in ("/console/jobs?state=failed", f"/console/jobs/{rows['failed']}", "/"):
        got = attacker.evaluate(
            "async (p) => { const r = await fetch(p); return [r.status, await r.text()]; }", path
        )
        assert got[0] == 421, (path, got)
        assert "report.build" not in got[1] and "quarterly-needle" not in got[1]
    assert attacker.goto(f"http://{REBIND}:{port}/console/").status == 421

    page = context.new_page()
    base = f"http://localhost:{port}/"
    page.goto(base + "console/login")
    page.fill("input[name=token]", TOKEN)
    page.fill("input[name=name]", "carol")
    page.click("form.signin button")
    page.wait_for_url(base + "console/")
    assert "signed in as carol" in page.inner_text("header")
    page.goto(base + f"console/jobs/{rows['failed']}")
    page.click("#actions button:text('Retry')")
    assert f"task {rows['failed']} retried" in page.inner_text(".flash")
    assert state(conn, schema, rows["failed"]) == "queued"
    page.goto(base + "console/")
    cell = page.locator('tr[data-queue="emails"] td[data-col="queued"]')
    assert cell.inner_text() == "5"
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('mail.send', 'emails')")
    wait_until(lambda: cell.inner_text() == "6", timeout=15, interval=0.2)


def test_a_payload_downloads_whole_from_its_page(
    browser: Contexts,
    readonly: MetricsServer,
    schema: str,
    conn: psycopg.Connection,
    rows: dict[str, Any],
) -> None:
    page = browser.new_context(accept_downloads=True).new_page()
    page.goto(readonly.url + f"console/jobs/{rows['failed']}")
    assert "quarterly-needle" in page.inner_text("#payload")
    with page.expect_download() as download:
        page.click("#payload-download")
    assert download.value.suggested_filename == f"task-{rows['failed']}-payload.json"
    want = conn.execute(
        f"SELECT payload::text FROM {schema}.tasks WHERE id = %s", (rows["failed"],)
    ).fetchone()
    assert want is not None
    assert Path(download.value.path()).read_text() == want[0]
