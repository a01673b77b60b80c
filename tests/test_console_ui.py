"""The console and the status page as one UI, in a real browser (headless Chromium): the charts
have their axes and labels and plot the database's figures, each task state has one colour (with
its label, readable) wherever it shows, each panel's explanation stays hidden until its "?" is
opened, every page shows times one way, and the status page shows the console's overview without
the actions.

With WORKER_WRITE_SCREENSHOTS=1, ``test_pages_render_for_the_docs`` writes the screenshots of
docs/images/ (1280x800); otherwise it checks the same pages and keeps its screenshots in tmp_path.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import spawn_cli, wait_until
from test_console import (  # noqa: F401  (fixtures)
    TOKEN,
    Contexts,
    browser,
    playwright_browser,
    sign_in,
    sync_playwright,
)
from test_pool import kill_tree

import worker
from worker.db.migrate import migrate
from worker.db.sql import queries
from worker.engine import rollup
from worker.monitor.console import charts as console_charts
from worker.monitor.page.charts import count_label
from worker.monitor.server import MetricsServer, serve

pytestmark = pytest.mark.skipif(
    (shutil.which("chromium") or shutil.which("chromium-browser")) is None
    or sync_playwright is None,
    reason="needs chromium and playwright (see tests/test_console.py)",
)

ROOT = Path(__file__).resolve().parent.parent
DOCS_IMAGES = ROOT / "docs" / "images"
STATES = ("waiting", "scheduled", "queued", "in_progress", "done", "failed", "cancelled")
LABELS = {s: s.replace("_", " ") for s in STATES}
TIME_TEXT = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$")
TIME_ATTR = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
RELATIVE = re.compile(r"^(just now|\d[\d,]* (s|min|h|d) ago|in \d[\d,]* (s|min|h|d))$")
A_DATE = re.compile(r"\d{4}-\d\d-\d\d")


def _minute(conn: psycopg.Connection, ago: int) -> datetime:
    row = conn.execute(
        "SELECT date_trunc('minute', now()) - make_interval(mins => %s)", (ago,)
    ).fetchone()
    assert row is not None
    return row[0]


def _finish(
    conn: psycopg.Connection,
    schema: str,
    queue: str,
    state: str,
    at: datetime,
    wait: float,
    task: str = "mail.send",
) -> None:
    """A task that finished at ``at`` after waiting ``wait`` seconds to start (and running 1 s)."""
    started = at - timedelta(seconds=1)
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, max_attempts, run_at,"
        " created_at, started_at, finished_at, last_error, payload) VALUES (%s, %s, %s, 1, 3, %s,"
        " %s, %s, %s, %s, jsonb_build_object('to', 'customer-' || (random() * 900 + 100)::int ||"
        " '@example.com', 'template', 'receipt'))",
        (
            task,
            queue,
            state,
            started - timedelta(seconds=wait),
            started - timedelta(seconds=wait),
            started,
            at,
            "TimeoutError: the mail server did not answer" if state == "failed" else None,
        ),
    )


def _set_waiting(conn: psycopg.Connection, schema: str, queue: str, n: int) -> None:
    """Make ``queue`` hold exactly ``n`` queued tasks."""
    have = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE queue = %s AND state = 'queued'", (queue,)
    ).fetchone()[0]  # type: ignore[index]
    if n > have:
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, payload) SELECT 'mail.send', %s,"
            " jsonb_build_object('to', 'user' || g || '@example.com')"
            " FROM generate_series(1, %s) AS g",
            (queue, n - have),
        )
    elif n < have:
        conn.execute(
            f"DELETE FROM {schema}.tasks WHERE id IN (SELECT id FROM {schema}.tasks"
            " WHERE queue = %s AND state = 'queued' ORDER BY id LIMIT %s)",
            (queue, have - n),
        )


def _record(conn: psycopg.Connection, schema: str, minute: datetime) -> None:
    """Record ``minute`` of the rollup now, dated as a worker records it: a little after it."""
    assert rollup.record_minute(conn, queries(schema), minute=minute) == minute
    conn.execute(
        f"UPDATE {schema}.stats_minutes SET sampled_at = minute + interval '65 seconds'"
        " WHERE minute = %s",
        (minute,),
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


@pytest.fixture
def figures(schema: str, conn: psycopg.Connection) -> dict[str, Any]:
    """Tasks finished in known minutes, a rollup of known depths, a task in each state, a cron
    schedule and its run, a lock row, a worker, a paused queue: what the pages must show."""
    s = schema
    waits: dict[datetime, list[float]] = {}
    for ago, done, failed in ((5, 4, 1), (3, 7, 0), (1, 0, 2)):
        m = _minute(conn, ago)
        for i in range(done + failed):
            wait = 0.5 * (i + 1)
            at = m + timedelta(seconds=10 + i)
            _finish(conn, s, "emails", "done" if i < done else "failed", at, wait)
            waits.setdefault(m, []).append(wait)
    depth = {}
    for ago, queued, running in ((6, 3, 0), (5, 9, 1), (4, 6, 2), (3, 12, 2), (2, 4, 1)):
        m = _minute(conn, ago)
        _set_waiting(conn, s, "emails", queued)
        conn.execute(f"DELETE FROM {s}.tasks WHERE state = 'in_progress'")
        conn.execute(
            f"INSERT INTO {s}.tasks (task, queue, state, attempts, started_at, lease_expires_at)"
            " SELECT 'report.build', 'reports', 'in_progress', 1, now(),"
            " now() + interval '10 minutes' FROM generate_series(1, %s)",
            (running,),
        )
        _record(conn, s, m)
        depth[m + timedelta(seconds=65)] = (queued, running)
    ids = {}
    for state in STATES:
        running = state == "in_progress"
        finished = state in ("done", "failed", "cancelled")
        row = conn.execute(
            f"INSERT INTO {s}.tasks (task, queue, state, run_at, attempts, started_at,"
            " lease_expires_at, finished_at) VALUES ('report.build', 'reports', %s,"
            " now() + %s * interval '1 hour', %s, %s, %s, %s) RETURNING id",
            (
                state,
                1 if state == "scheduled" else 0,
                1 if running or state in ("done", "failed") else 0,
                datetime.now(UTC) if running else None,
                datetime.now(UTC) + timedelta(minutes=10) if running else None,
                datetime.now(UTC) if finished else None,
            ),
        ).fetchone()
        assert row is not None
        ids[state] = int(row[0])
    conn.execute(
        f"INSERT INTO {s}.cron_schedules (key, expr, task) VALUES"
        " ('nightly-report', '0 3 * * *', 'report.build')"
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, state, cron_key, cron_at, finished_at) VALUES"
        " ('report.build', 'reports', 'done', 'nightly-report', now() - interval '1 day',"
        " now() - interval '1 day')"
    )
    conn.execute(
        f"INSERT INTO {s}.locks (name, holder, expires_at) VALUES"
        " ('invoice-sync', 'box-1:4242:abc', now() + interval '1 minute')"
    )
    conn.execute(
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency)"
        " VALUES (gen_random_uuid(), 'box-7', 4242, ARRAY['emails', 'reports'], 8)"
    )
    conn.execute(f"INSERT INTO {s}.paused_queues (queue, paused_by) VALUES ('exports', 'alice')")
    return {"waits": waits, "depth": depth, "ids": ids}


@pytest.fixture
def server(pg_dsn: str, schema: str, figures: dict[str, Any]) -> Iterator[MetricsServer]:
    """An armed console whose data stays cached for a minute (one set of figures for every page
    a test opens) and that does not refresh itself under the test."""
    s = serve(
        "127.0.0.1",
        0,
        dsn=pg_dsn,
        schema=schema,
        ttl=60,
        console_token=TOKEN,
        console_refresh=0,
    )
    yield s
    s.stop()


# -- charts ----------------------------------------------------------------------------------------

CHART_JS = """(id) => {
  const svg = document.getElementById(id);
  if (!svg) return null;
  const attrs = {};
  for (const a of svg.attributes) attrs[a.name] = a.value;
  const texts = (sel) => Array.from(svg.querySelectorAll(sel)).map((t) => t.textContent);
  const marks = Array.from(svg.querySelectorAll("g.bar, g.mark")).map((g) => {
    const data = {};
    for (const a of g.attributes) if (a.name.startsWith("data-")) data[a.name.slice(5)] = a.value;
    data.shapes = Array.from(g.querySelectorAll("rect, circle")).map((r) => ({
      cls: r.getAttribute("class"),
      x: Number(r.getAttribute("x") ?? r.getAttribute("cx")),
      y: Number(r.getAttribute("y") ?? r.getAttribute("cy")),
      height: Number(r.getAttribute("height") ?? 0),
    }));
    data.title = g.querySelector("title")?.textContent;
    return data;
  });
  return {
    attrs,
    axes: svg.querySelectorAll("line.axis-x, line.axis-y").length,
    yTicks: texts("text.tick-y"),
    xTicks: texts("text.tick-x"),
    titles: texts("text.axis-title"),
    lines: svg.querySelectorAll("polyline").length,
    marks,
  };
}"""


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class Geometry:
    """The scales of a chart, from the attributes it carries."""

    def __init__(self, attrs: dict[str, str]) -> None:
        self.top = float(attrs["data-plot-top"])
        self.bottom = float(attrs["data-plot-bottom"])
        self.left = float(attrs["data-plot-left"])
        self.right = float(attrs["data-plot-right"])
        self.y_max = float(attrs["data-y-max"])
        self.start = _when(attrs["data-start"])
        self.end = _when(attrs["data-end"])

    def x(self, at: datetime) -> float:
        span = (self.end - self.start).total_seconds()
        return self.left + (at - self.start).total_seconds() / span * (self.right - self.left)

    def height(self, value: float) -> float:
        return value / self.y_max * (self.bottom - self.top)

    def y(self, value: float) -> float:
        return self.bottom - self.height(value)


def _check_axes(chart: dict[str, Any], y_title: str) -> None:
    assert chart["axes"] == 2
    assert len(chart["yTicks"]) >= 2 and chart["yTicks"][0] == "0"
    assert len(chart["xTicks"]) >= 2 and all(re.fullmatch(r"\d\d:\d\d", t) for t in chart["xTicks"])
    assert chart["titles"] == [y_title, "time (UTC)"]


@pytest.mark.parametrize("path", ["console/", ""])
def test_charts_plot_the_databases_figures_with_axes_and_labels(
    browser: Contexts,  # noqa: F811
    server: MetricsServer,
    schema: str,
    conn: psycopg.Connection,
    figures: dict[str, Any],
    path: str,
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    refused: list[str] = []
    page.on("console", lambda m: refused.append(m.text) if "Security Policy" in m.text else None)
    page.goto(server.url + path)
    # Drawn without anything the page's Content-Security-Policy would have to allow.
    assert refused == []

    # Throughput: one bar per minute counted, its parts the database's count of that minute.
    tp = page.evaluate(CHART_JS, "chart-throughput")
    _check_axes(tp, "tasks / minute")
    g = Geometry(tp["attrs"])
    assert tp["yTicks"][-1] == count_label(g.y_max)
    counted = {
        at: (done, failed)
        for at, done, failed in conn.execute(
            f"SELECT date_trunc('minute', finished_at), count(*) FILTER (WHERE state = 'done'),"
            f" count(*) FILTER (WHERE state = 'failed') FROM {schema}.tasks"
            " WHERE state IN ('done', 'failed') AND finished_at >= %s GROUP BY 1",
            (g.start,),
        )
    }
    plotted = {
        _when(b["minute"]): (int(b["done"]), int(b["failed"])) for b in tp["marks"] if b["done"]
    }
    assert {k: v for k, v in plotted.items() if v != (0, 0)} == counted
    assert sum(d for d, _ in counted.values()) >= 11  # the seeded minutes are all there
    for bar in tp["marks"]:
        done, failed = int(bar["done"]), int(bar["failed"])
        rects = {r["cls"]: r for r in bar["shapes"]}
        assert rects["fill-done"]["height"] == pytest.approx(g.height(done), abs=0.15)
        assert rects["fill-failed"]["height"] == pytest.approx(g.height(failed), abs=0.15)
        assert rects["fill-done"]["y"] == pytest.approx(g.y(done), abs=0.15)
        assert rects["fill-done"]["x"] == pytest.approx(g.x(_when(bar["minute"])) + 0.5, abs=0.15)
        assert f"{done:,} done, {failed:,} failed" in bar["title"]

    # Queue depth: a point per recorded minute, at the rollup's figures.
    depth = page.evaluate(CHART_JS, "chart-depth")
    _check_axes(depth, "tasks")
    g = Geometry(depth["attrs"])
    stored = {
        at: (q, r)
        for at, q, r in conn.execute(
            f"SELECT sampled_at, queued, in_progress FROM {schema}.stats_minutes"
        )
    }
    assert stored == figures["depth"]
    shown = {_when(m["at"]): (int(m["queued"]), int(m["in-progress"])) for m in depth["marks"]}
    assert shown == figures["depth"]
    assert depth["lines"] == 2  # queued and in progress, joined minute to minute
    for m in depth["marks"]:
        dots = {d["cls"]: d for d in m["shapes"]}
        at = _when(m["at"])
        for key, value in (("pt pt-queued", m["queued"]), ("pt pt-in_progress", m["in-progress"])):
            assert dots[key]["x"] == pytest.approx(g.x(at), abs=0.15)
            assert dots[key]["y"] == pytest.approx(g.y(float(value)), abs=0.15)

    # Wait times of the queue: p50 and p99 of each recorded minute, computed anew here.
    figure = page.locator('figure[data-wait-queue="emails"]')
    assert "emails" in figure.locator("figcaption").inner_text()
    chart_id = figure.locator("svg").get_attribute("id")
    wait = page.evaluate(CHART_JS, chart_id)
    _check_axes(wait, "wait")
    g = Geometry(wait["attrs"])
    recorded = {m: v for m, v in figures["waits"].items() if m + timedelta(seconds=65) in stored}
    assert len(recorded) == 2
    shown_waits = {
        _when(m["at"]) - timedelta(seconds=30): (int(m["tasks"]), float(m["p50"]), float(m["p99"]))
        for m in wait["marks"]
    }
    assert set(shown_waits) == set(recorded)
    for minute, values in recorded.items():
        tasks, p50, p99 = shown_waits[minute]
        assert tasks == len(values)
        assert p50 == pytest.approx(_percentile(values, 0.5), rel=1e-6)
        assert p99 == pytest.approx(_percentile(values, 0.99), rel=1e-6)
    for m in wait["marks"]:
        dots = {d["cls"]: d for d in m["shapes"]}
        assert dots["pt pt-p50"]["y"] == pytest.approx(g.y(float(m["p50"])), abs=0.15)
        assert dots["pt pt-p99"]["y"] == pytest.approx(g.y(float(m["p99"])), abs=0.15)
    # Each chart says in words what its colours are.
    legends = page.locator("ul.legend").all_inner_texts()
    assert any("done" in t and "failed for good" in t for t in legends)
    assert any("queued" in t and "in progress" in t for t in legends)
    assert any("p50" in t and "p99" in t for t in legends)


# -- state colours ---------------------------------------------------------------------------------

STYLE_JS = """(sel) => Array.from(document.querySelectorAll(sel)).map((e) => {
  const s = getComputedStyle(e);
  return {text: e.innerText, color: s.color, background: s.backgroundColor, fill: s.fill,
          stroke: s.stroke};
})"""


def _rgb(css: str) -> tuple[int, int, int]:
    match = re.match(r"rgba?\((\d+), (\d+), (\d+)", css)
    assert match, css
    return int(match[1]), int(match[2]), int(match[3])


def _contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    def luminance(c: tuple[int, int, int]) -> float:
        channels = [v / 255 for v in c]
        linear = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_each_state_has_one_readable_colour_and_its_label_everywhere(
    browser: Contexts,  # noqa: F811
    server: MetricsServer,
    figures: dict[str, Any],
) -> None:
    page = browser.new_page()
    seen: dict[str, set[tuple[str, str]]] = {s: set() for s in STATES}
    where: dict[str, set[str]] = {s: set() for s in STATES}
    pages = ["", "console/", "console/jobs", "console/queues", "console/cron"]
    pages += [f"console/jobs/{i}" for i in figures["ids"].values()]
    for path in pages:
        page.goto(server.url + path)
        for state in STATES:
            for badge in page.evaluate(STYLE_JS, f".state.state-{state}"):
                seen[state].add((badge["color"], badge["background"]))
                where[state].add(path)
                assert badge["text"].startswith(LABELS[state]), (path, state, badge)
    colours = {}
    for state in STATES:
        # Shown on the overview, in the job browser and on its task's page, always alike.
        assert {"", "console/", "console/jobs", f"console/jobs/{figures['ids'][state]}"} <= where[
            state
        ]
        assert len(seen[state]) == 1, (state, seen[state])
        ((color, background),) = seen[state]
        assert _contrast(_rgb(color), _rgb(background)) >= 4.5, state
        assert _contrast(_rgb(color), (255, 255, 255)) >= 4.5, state
        colours[state] = _rgb(color)
    assert len(set(colours.values())) == len(STATES)  # seven states, seven colours
    # The charts draw done, failed, queued and in progress in the same colours.
    page.goto(server.url + "console/")
    for sel, state, prop in (
        ("svg .fill-done", "done", "fill"),
        ("svg .fill-failed", "failed", "fill"),
        ("svg .pt-queued", "queued", "fill"),
        ("svg .line-in_progress", "in_progress", "stroke"),
        ("ul.legend .key-done", "done", "background"),
        (".card-failed", "failed", "borderTopColor"),
    ):
        styles = page.evaluate(
            """([sel, prop]) => Array.from(document.querySelectorAll(sel))
                 .map((e) => getComputedStyle(e)[prop])""",
            [sel, prop],
        )
        assert styles and {_rgb(v) for v in styles} == {colours[state]}, (sel, styles)


# -- the "?" of each panel ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["console/", "", "console/jobs", "console/queues"])
def test_explanations_stay_hidden_until_their_question_mark_is_opened(
    browser: Contexts,  # noqa: F811
    server: MetricsServer,
    path: str,
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server.url + path)
    helps = page.locator("details.help")
    assert helps.count() >= (10 if path in ("", "console/") else 1)
    if path in ("", "console/"):
        # Every panel of the overview but the headline cards has one, beside its heading.
        panels = page.locator("section.panel:not(.panel-cards)")
        assert panels.count() == page.locator("section.panel .panel-head details.help").count()
    for i in range(helps.count()):
        box = helps.nth(i)
        body = box.locator(".help-body")
        assert box.get_attribute("open") is None
        assert not body.is_visible()
        assert box.locator("summary").inner_text() == "?"
        box.locator("summary").click()
        assert body.is_visible() and len(body.inner_text()) > 40
        box.locator("summary").click()
        assert not body.is_visible()


# -- one way to show a time ------------------------------------------------------------------------

TIMES_JS = """() => {
  const times = Array.from(document.querySelectorAll("main time")).map((t) => ({
    text: t.textContent, datetime: t.getAttribute("datetime"), title: t.getAttribute("title"),
  }));
  const main = document.querySelector("main").cloneNode(true);
  main.querySelectorAll("time, details.help, svg, pre, code, td.err").forEach((t) => t.remove());
  return {times, rest: main.innerText};
}"""


def test_every_page_shows_times_one_way(
    browser: Contexts,  # noqa: F811
    server: MetricsServer,
    figures: dict[str, Any],
) -> None:
    page = browser.new_page()
    pages = [
        "",
        "console/",
        "console/jobs",
        "console/jobs?state=done",
        f"console/jobs/{figures['ids']['failed']}",
        f"console/jobs/{figures['ids']['in_progress']}",
        "console/queues",
        "console/cron",
        "console/locks",
    ]
    for path in pages:
        page.goto(server.url + path)
        found = page.evaluate(TIMES_JS)
        assert found["times"], path
        for t in found["times"]:
            assert TIME_TEXT.match(t["text"]), (path, t)
            assert TIME_ATTR.match(t["datetime"]), (path, t)
            assert t["text"][:10] == t["datetime"][:10] and t["text"][11:19] == t["datetime"][11:19]
            assert RELATIVE.match(t["title"]), (path, t)
        # No date shown any other way (payloads, errors and code aside: they are data).
        assert not A_DATE.search(found["rest"]), (path, A_DATE.findall(found["rest"]))


# -- the status page is the overview -------------------------------------------------------------

PANELS_JS = """() => Array.from(document.querySelectorAll("main section.panel")).map((p) => {
  const copy = p.cloneNode(true);
  // The actions: the cells that hold a button, and their column's empty heading.
  copy.querySelectorAll("form").forEach((f) => (f.closest("td") || f).remove());
  copy.querySelectorAll("th").forEach((th) => { if (!th.textContent.trim()) th.remove(); });
  return {id: p.id, text: copy.innerText, svg: Array.from(copy.querySelectorAll("svg"))
          .map((s) => s.outerHTML)};
})"""


def test_the_status_page_is_the_consoles_overview_without_the_actions(
    browser: Contexts,  # noqa: F811
    server: MetricsServer,
    conn: psycopg.Connection,
    schema: str,
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    sign_in(page, server)
    page.goto(server.url + "console/")
    console = page.evaluate(PANELS_JS)
    # Signed in, the console offers actions on its overview: the paused queue's Resume.
    resume = page.locator('#live-paused tr[data-paused="exports"] form button')
    assert resume.inner_text() == "Resume"
    assert page.locator("main form[method=post]").count() >= 1
    page.goto(server.url)
    status = page.evaluate(PANELS_JS)
    assert [p["id"] for p in status] == [p["id"] for p in console]
    assert len(console) >= 12
    for mine, theirs in zip(status, console, strict=True):
        assert mine["text"] == theirs["text"], mine["id"]
        assert mine["svg"] == theirs["svg"], mine["id"]
    # The status page: no action, no form, no script, and nothing it says about signing in.
    html = page.content()
    assert page.locator("form").count() == 0 and "<script" not in html
    assert "sign out" not in page.inner_text("body") and "Resume" not in page.inner_text("main")
    assert page.title().startswith("worker status")
    # Both in the same UI: the same style, the same navigation.
    assert page.locator("header nav a").all_inner_texts() == [
        "Overview",
        "Jobs",
        "Queues",
        "Cron",
        "Locks",
    ]
    assert page.evaluate("getComputedStyle(document.querySelector('.state-failed')).color") == (
        "rgb(185, 28, 28)"
    )


# -- the pages, and the screenshots of the docs -------------------------------------------------


def _optimised(png: bytes) -> bytes:
    """The same PNG with its image data compressed as much as zlib can (Chromium favours speed)."""
    chunks, pos, data = [], 8, b""
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind = png[pos + 4 : pos + 8]
        body = png[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IDAT":
            data += body
            continue
        if kind == b"IEND" and data:
            packed = zlib.compress(zlib.decompress(data), 9)
            chunks.append((b"IDAT", packed))
        if kind in (b"IHDR", b"IEND", b"PLTE", b"tRNS"):
            chunks.append((kind, body))
    out = [png[:8]]
    for kind, body in chunks:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        out.append(struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc))
    return b"".join(out)


WRITE = os.environ.get("WORKER_WRITE_SCREENSHOTS") == "1"


@pytest.fixture
def docs_schema(pg_dsn: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """The schema the screenshots show: "shop" when they are written for the docs, else the
    test's own."""
    if not WRITE:
        yield request.getfixturevalue("schema")
        return
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("DROP SCHEMA IF EXISTS shop CASCADE")
        migrate(c, "shop")
    yield "shop"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("DROP SCHEMA IF EXISTS shop CASCADE")


@pytest.fixture
def showcase(docs_schema: str, conn: psycopg.Connection) -> dict[str, Any]:
    """An hour of a small installation: three queues with their rates, failures and waits, the
    depth rising and falling, the rollup of each minute, a worker, a paused queue."""
    s = docs_schema
    rates = {"emails": 18, "reports": 6, "images": 10}
    now = _minute(conn, 0)  # once: filling the hour may take past the end of a minute
    for ago in range(60, 0, -1):
        m = now - timedelta(minutes=ago)
        swell = 1 + 0.6 * ((ago % 20) / 20)
        for q, rate in rates.items():
            n = int(rate * swell)
            base = {"emails": 0.12, "reports": 0.6, "images": 0.25}[q] * swell
            for i in range(n):
                state = "failed" if (i * 7 + ago) % 37 == 0 else "done"
                wait = base * (0.6 + 0.8 * ((i * 37) % 100) / 100)
                if i == n - 1:  # the slowest start of the minute
                    wait = base * (3 + 2 * ((ago % 12) / 12))
                _finish(conn, s, q, state, m + timedelta(seconds=2 + i * 55 / n), wait)
        backlog = int(40 + 35 * abs(10 - ago % 20) / 10 + (ago % 7))
        _set_waiting(conn, s, "emails", backlog)
        _set_waiting(conn, s, "reports", backlog // 4)
        conn.execute(f"DELETE FROM {s}.tasks WHERE state = 'in_progress'")
        conn.execute(
            f"INSERT INTO {s}.tasks (task, queue, state, attempts, started_at, lease_expires_at)"
            " SELECT 'mail.send', 'emails', 'in_progress', 1, now(),"
            " now() + interval '10 minutes' FROM generate_series(1, %s)",
            (4 + ago % 5,),
        )
        if ago > 1:
            _record(conn, s, m)
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, run_at) SELECT 'report.build', 'reports',"
        " now() + g * interval '1 minute' FROM generate_series(1, 25) AS g"
    )
    conn.execute(
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency, in_flight, tasks)"
        " SELECT gen_random_uuid(), h, p, ARRAY['emails', 'reports', 'images'], 8, n,"
        " ARRAY['mail.send', 'report.build']"
        " FROM (VALUES ('web-1', 4242, 6), ('web-2', 5151, 3)) AS w(h, p, n)"
    )
    conn.execute(f"INSERT INTO {s}.paused_queues (queue, paused_by) VALUES ('images', 'alice')")
    row = conn.execute(
        f"SELECT id FROM {s}.tasks WHERE state = 'failed' ORDER BY finished_at DESC LIMIT 1"
    ).fetchone()
    assert row is not None
    return {"failed": int(row[0])}


def test_pages_render_for_the_docs(
    browser: Contexts,  # noqa: F811
    pg_dsn: str,
    docs_schema: str,
    showcase: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each page of the console and the status page, as the docs show them (1280x800)."""
    folder = DOCS_IMAGES if WRITE else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    # The first view counts the whole hour (a console counts 15 settled minutes a refresh).
    monkeypatch.setattr(console_charts, "MINUTES_PER_REFRESH", 60)
    srv = serve(
        "127.0.0.1",
        0,
        dsn=pg_dsn,
        schema=docs_schema,
        console_token=TOKEN,
        console_refresh=0,
    )
    try:
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        page.goto(srv.url + "console/")
        assert "not counted yet" not in page.inner_text("#live-throughput")
        sign_in(page, srv)
        shots = {
            "console-overview": ("console/", "#chart-throughput g.bar"),
            "console-waits": ("console/#waits", "#chart-waits g.mark"),
            "console-jobs": ("console/jobs?state=done", "table.jobs tbody tr"),
            "console-job": (f"console/jobs/{showcase['failed']}", "table.fields tr"),
            "console-queues": ("console/queues", "table.queues tbody tr"),
            "status-page": ("", "#chart-depth g.mark"),
        }
        for name, (path, expected) in shots.items():
            page.goto(srv.url + path)
            assert page.locator(expected).count() >= 3, (name, expected)
            path_png = folder / f"{name}.png"
            path_png.write_bytes(_optimised(page.screenshot()))
            png = path_png.read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n"
            assert struct.unpack(">II", png[16:24]) == (1280, 800)
            assert len(png) < 400_000, (name, len(png))
    finally:
        srv.stop()


# -- a workflow's page, with real workers ---------------------------------------------------------


def _save(page: Any, folder: Path, name: str) -> None:
    """A screenshot of the page as the docs show it (1280x800, compressed)."""
    path_png = folder / f"{name}.png"
    path_png.write_bytes(_optimised(page.screenshot()))
    png = path_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1280, 800)
    assert len(png) < 400_000, (name, len(png))


def test_a_workflow_runs_fails_is_retried_and_cancelled_from_its_page(
    browser: Contexts,  # noqa: F811
    pg_dsn: str,
    docs_schema: str,
    conn: psycopg.Connection,
    tmp_path: Path,
) -> None:
    """Real `worker run` processes run a chain, a group of four and their join, one of the four
    failing (its service is down): the workflow's page shows each step in dependency order with
    its task, state, attempts, time run, dependencies and error, refreshing itself as they run.
    The operator retries the failed step from the page once the service is up, and the
    workflow finishes; a second workflow is cancelled from its page while its first step runs.
    With WORKER_WRITE_SCREENSHOTS=1 the page is saved as docs/images/console-workflow.png."""
    s = docs_schema
    ready = tmp_path / "stock-service-up"
    flow = worker.Workflow("nightly-orders")
    fetch = flow.add("orders.fetch", {"orders": 120})
    split = flow.add("orders.split", depends_on=[fetch])
    prices = [flow.add("orders.price", {"unit": u}, depends_on=[split]) for u in (3, 5, 7)]
    stock = flow.add("orders.check_stock", {"ready_if": str(ready)}, depends_on=[split])
    merge = flow.add("orders.merge", depends_on=[*prices, stock])
    invoice = flow.add("orders.invoice", depends_on=[merge])
    wf = worker.enqueue_workflow(conn, flow, schema=s)
    ordered = [fetch, split, *prices, stock, merge, invoice]
    assert [wf[x] for x in ordered] == sorted(wf.ids.values())  # ids in dependency order
    names = ["fetch", "split", "price", "price", "price", "check_stock", "merge", "invoice"]

    fleet = spawn_cli(
        "run", "console_flows_module", "--dsn", pg_dsn, "--schema", s, "--concurrency", "4",
        "--poll-interval", "0.2", "--log-level", "WARNING", stderr=subprocess.DEVNULL,
    )  # fmt: skip
    srv = serve(
        "127.0.0.1", 0, dsn=pg_dsn, schema=s, ttl=0, console_token=TOKEN, console_refresh=1.0
    )
    try:
        page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
        sign_in(page, srv)
        page.goto(srv.url + f"console/workflows/{wf.id}")
        assert page.locator("main h2").first.inner_text() == f"Workflow {wf.id} nightly-orders"

        def cell(step: Any, col: str) -> str:
            return page.locator(f'tr[data-step="{wf[step]}"] td[data-col="{col}"]').inner_text()

        def states() -> list[str]:
            return [cell(x, "state").split()[0] for x in ordered]

        # The page refreshes itself while the workers run the steps, until the failure has
        # cancelled what depends on it.
        page.evaluate("window.__not_reloaded = true")
        # (The failure cancels the join at once, maybe while the other three still run.)
        expected = ["done"] * 5 + ["failed", "cancelled", "cancelled"]
        wait_until(lambda: states() == expected, timeout=60, interval=0.2)
        assert page.evaluate("window.__not_reloaded") is True
        rows = page.locator("table.steps tbody tr")
        assert rows.evaluate_all("rs => rs.map((r) => Number(r.dataset.step))") == [
            wf[x] for x in ordered
        ]
        assert [cell(x, "task") for x in ordered] == [f"orders.{n}" for n in names]
        assert cell(stock, "attempts") == "1/1"
        assert "the stock service did not answer" in cell(stock, "error")
        assert cell(merge, "error") == (
            f"DependencyFailed: step {wf[stock]} (orders.check_stock) ended failed"
        )
        assert all(cell(x, "ran").endswith(("ms", " s")) for x in ordered[:6])
        assert cell(merge, "ran") == "-"
        # What each step waits for, and what each of those came to.
        assert cell(fetch, "after") == "-"
        assert cell(split, "after") == f"{wf[fetch]} done"
        assert cell(merge, "after").split("\n") == [
            *(f"{wf[x]} done" for x in prices),
            f"{wf[stock]} failed",
        ]
        counts = {
            c.get_attribute("data-count"): c.locator("b").inner_text()
            for c in page.locator("[data-count]").all()
        }
        assert counts == {
            "waiting": "0",
            "scheduled": "0",
            "queued": "0",
            "in_progress": "0",
            "done": "5",
            "failed": "1",
            "cancelled": "2",
        }
        assert page.inner_text("#wf-progress") == "finished"
        assert page.locator("#actions").count() == 0  # nothing left to cancel
        retry = page.locator("table.steps button:text('Retry')")
        assert retry.count() == 1
        assert page.locator(f'tr[data-step="{wf[stock]}"] button').inner_text() == "Retry"
        _save(page, DOCS_IMAGES if WRITE else tmp_path, "console-workflow")

        # The service is back: retry the failed step from the page; the workflow finishes.
        ready.touch()
        page.locator(f'tr[data-step="{wf[stock]}"] button:text("Retry")').click()
        assert f"step {wf[stock]} retried" in page.inner_text(".flash")
        wait_until(lambda: cell(invoice, "state") == "done", timeout=60, interval=0.2)
        assert states() == ["done"] * 8
        assert cell(merge, "after").split("\n") == [f"{wf[x]} done" for x in [*prices, stock]]
        assert page.inner_text("#wf-progress") == "finished"
        assert conn.execute(
            f"SELECT inputs FROM {s}.tasks WHERE id = %s", (wf[merge],)
        ).fetchone() == ([120, 200, 280, 40],)

        # A second workflow, cancelled from its page while its first step runs.
        long = worker.Workflow("backfill")
        export = long.add("orders.export", {"seconds": 120})
        after = long.add("orders.merge", depends_on=[export])
        last = long.add("orders.invoice", depends_on=[after])
        wf2 = worker.enqueue_workflow(conn, long, schema=s)
        page.goto(srv.url + f"console/workflows/{wf2.id}")
        wait_until(
            lambda: (
                page.locator(f'tr[data-step="{wf2[export]}"] td[data-col="state"]').inner_text()
                == "in progress"
            ),
            timeout=30,
            interval=0.2,
        )
        assert page.inner_text("#wf-progress") == "3 step(s) not finished"
        page.locator("#actions button:text('Cancel workflow')").click()
        assert f"workflow {wf2.id}: 3 step(s) cancelled or asked to stop" in page.inner_text(
            ".flash"
        )

        def state2(step: Any) -> str:
            cell = page.locator(f'tr[data-step="{wf2[step]}"] td[data-col="state"]')
            return cell.inner_text().split()[0]

        # Its worker stops the running step: the page shows it cancelled, as the rest.
        wait_until(lambda: state2(export) == "cancelled", timeout=30, interval=0.2)
        assert [state2(x) for x in (export, after, last)] == ["cancelled"] * 3
        assert page.inner_text("#wf-progress") == "finished"
        assert conn.execute(
            f"SELECT cancelled_by, finished_at - started_at < interval '60 s' FROM {s}.tasks"
            " WHERE id = %s",
            (wf2[export],),
        ).fetchone() == ("alice", True)
        audit = conn.execute(
            f"SELECT actor, action, filter FROM {s}.actions WHERE source = 'console' ORDER BY id"
        ).fetchall()
        assert audit == [
            ("alice", "retry", {"task_id": wf[stock], "workflow_id": wf.id}),
            ("alice", "cancel workflow", {"workflow_id": wf2.id}),
        ]
        # The task page of a step leads to its workflow's page.
        page.goto(srv.url + f"console/jobs/{wf[merge]}")
        page.click("#workflow-link")
        page.wait_for_url(f"**/console/workflows/{wf.id}#step-{wf[merge]}")
    finally:
        srv.stop()
        kill_tree(fleet)
