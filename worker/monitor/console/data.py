"""The console's own reads and its actions, on connections apart from the status page's.

The status page and /metrics share one cached connection (``readmodel.Database``); a person
browsing jobs or pressing a button must not make a scrape wait, so the console has up to three
connections of its own. Every read runs in a READ ONLY transaction, and everything (reads and
actions) under a statement timeout. Job pages are bounded by construction (browse.sql:
at most ``SCAN_ROWS`` rows walked per page); the throughput per minute is counted once per
settled minute and kept (see ``throughput``); the charts of queue depth and wait times read the
minute rollup the workers write (trends.sql), at most once per ``ttl``.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg.types.datetime import TimestamptzLoader
from psycopg_pool import PoolTimeout

from ...coord import pause as _pause
from ...db.connect import CONSOLE, pool
from ...db.dsn import scrub
from ...db.sql import queries
from ...ops import actions
from ..page.trends import Minute, Throughput, Trends
from .charts import MINUTE_CAP, Charts
from .filter import END, START, Filter, encode_cursor, walk_params

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

log = logging.getLogger("worker.console")

T = TypeVar("T")

PAGE_ROWS = 50
SCAN_ROWS = 100_000  # rows a job page walks at most
# Longest a request waits for one of the console's connections (all busy, or none can be made).
LOAN_SECONDS = 2.0
BULK_SCAN_ROWS = 500_000  # rows a bulk action walks at most to find its tasks
STATEMENT_TIMEOUT_MS = 5000
ROW_CHARS = 200  # error and payload on a row of the browser
ROW_NAME_CHARS = 255  # queue and task names on a row
WORKFLOW_STEPS = 200  # steps on a page of a workflow
STEP_DEPS = 10  # dependencies shown per step (the rest are counted)
STEP_DEPS_CAP = 100_001  # dependencies counted per step at most
DETAIL_CHARS = 65_536  # error, payload, result and error history on a task's page
DETAIL_NAME_CHARS = 1000
# A value stored larger than this (compressed, as pg_column_size says) is not read for a page at
# all: turning 50 MB of jsonb into text takes PostgreSQL a quarter of a second each time. Its
# download streams it whole.
STORED_BYTES = 256 * 1024
PRETTY_BYTES = 4096  # JSON up to this size is shown indented (jsonb_pretty)
DOWNLOAD_CHUNK = 1024 * 1024  # bytes a download reads from the database at a time


def task_params(task_id: int) -> dict[str, Any]:
    """The parameters of console_task, the statement of a task's page."""
    return {
        "id": task_id,
        "chars": DETAIL_CHARS,
        "name_chars": DETAIL_NAME_CHARS,
        "stored": STORED_BYTES,
        "pretty": PRETTY_BYTES,
    }


def download_params(task_id: int, what: str) -> dict[str, Any]:
    """The parameters of console_download and console_download_exists (``what``: payload,
    result or errors)."""
    return {"id": task_id, "what": what, "chunk": DOWNLOAD_CHUNK}


DOWNLOAD_MEMORY = 1024 * 1024  # bytes of a download held in memory; more wait in a file
TIMED_OUT = (
    f"gave up after {STATEMENT_TIMEOUT_MS / 1000:g} s: narrow the filter (a queue, a task, a state)"
)


class _Timestamptz(TimestamptzLoader):
    """timestamptz, with PostgreSQL's infinities read as the ends of Python's range (a producer
    could write them, and one row must not make a whole page fail)."""

    def load(self, data: Any) -> datetime:
        raw = bytes(data)
        if raw == b"infinity":
            return END
        if raw == b"-infinity":
            return START
        return super().load(data)


@dataclass
class Page:
    """One page of the job browser."""

    rows: list[dict[str, Any]]
    next_cursor: str | None = None  # the page after this one, when there is one
    scanned_to: str | None = None  # the walk stopped at its limit here, the page not full
    error: str | None = None


@dataclass
class WorkflowPage:
    """One workflow for its page: its row, its steps counted by state (with when the first
    started and the last finished), and one page of its steps in dependency order."""

    id: int
    name: str
    created_at: datetime
    counts: dict[str, int]
    first_started: datetime | None
    last_finished: datetime | None
    steps: list[dict[str, Any]]
    next_after: int | None  # the id the next page starts after, when there is one

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def unfinished(self) -> int:
        return sum(n for s, n in self.counts.items() if s not in ("done", "failed", "cancelled"))


def first_line(exc: BaseException) -> str:
    """An error's first line, any password it names replaced by ***."""
    text = str(exc).strip()
    return scrub(text.splitlines()[0] if text else type(exc).__name__)


def browse_statement(
    f: Filter, cursor: str | None, *, limit: int, scan: int, chars: int = ROW_CHARS
) -> tuple[str, dict[str, Any]]:
    """The statement of browse.sql that lists a page of ``f`` after ``cursor``, and its
    parameters: at most ``limit`` rows from a walk of at most ``scan``."""
    params: dict[str, Any] = {
        "chars": chars,
        "stored": STORED_BYTES,
        "queue": f.queue,
        "task": f.task,
        "state": f.state,
        "pattern": f.pattern(),
        "limit": limit + 2,  # one more than the page, and the walk's marker row
        # A walk whose every row matches needs no more rows than the page: saying so lets the
        # planner pick the index that is already in order.
        "scan": scan if f.narrows_walk else limit + 1,
        **walk_params(f.mode, cursor),
    }
    if f.id is not None:
        params["id"] = f.id
        return "browse_id", params
    return f"browse_{f.mode}", params


class ConsoleData(Charts):
    def __init__(self, dsn: str, schema: str, *, ttl: float = 10.0, connect_timeout: int = 3):
        self.schema = schema
        self.q = queries(schema, SQL_DIR)
        self.ttl = ttl
        # Up to three connections, kept between requests and checked before each loan. With the
        # database down a request fails within LOAN_SECONDS, and the page says so at once.
        self.connections = pool(
            dsn,
            replace(CONSOLE, connect_timeout=connect_timeout),
            max_size=3,
            name="worker-console",
            timeout=LOAN_SECONDS,
            reconnect_timeout=LOAN_SECONDS,
            session=False,
            setup=lambda conn: conn.adapters.register_loader("timestamptz", _Timestamptz),
        )
        Charts.__init__(self)
        self._down_until = 0.0  # monotonic time until which loans fail at once (see _loan)
        self._down_reason = ""

    def close(self) -> None:
        self.connections.close()

    def _run(self, fn: Callable[[psycopg.Connection], T], *, write: bool = False) -> T:
        """``fn`` in a transaction under the statement timeout, READ ONLY unless ``write`` (the
        pool checks a kept connection before lending it, so an action never runs twice).

        A read is REPEATABLE READ: all its statements see one moment, so a page's counts agree
        with its rows even while workers finish steps between them (and, being read only, it
        never fails to serialize)."""
        with self._loan() as conn, conn.transaction():
            if not write:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            conn.execute(
                "SELECT set_config('statement_timeout', %s, true),"
                " set_config('max_parallel_workers_per_gather', '0', true)",
                (str(STATEMENT_TIMEOUT_MS),),
            )
            conn.execute(self.q["no_jit"])
            return fn(conn)

    @contextmanager
    def _loan(self) -> Iterator[psycopg.Connection]:
        """One of the console's connections. When none could be had a moment ago (the database
        cannot be reached), fail at once: a page's other reads fail with its first."""
        if time.monotonic() < self._down_until:
            raise psycopg.OperationalError(self._down_reason)
        try:
            with self.connections.connection() as conn:
                yield conn
        except PoolTimeout as exc:  # raised by the loan alone, never by what runs on it
            self._down_until = time.monotonic() + LOAN_SECONDS
            self._down_reason = str(exc)
            raise

    # the job browser

    def browse(self, f: Filter, cursor: str | None, *, limit: int = PAGE_ROWS) -> Page:
        try:
            return self._run(lambda conn: self._browse(conn, f, cursor, limit, SCAN_ROWS))
        except psycopg.errors.QueryCanceled:
            return Page([], error=TIMED_OUT)
        except psycopg.Error as exc:
            return Page([], error=first_line(exc))

    def _browse(
        self,
        conn: psycopg.Connection,
        f: Filter,
        cursor: str | None,
        limit: int,
        scan: int,
        chars: int = ROW_CHARS,
    ) -> Page:
        statement, params = browse_statement(f, cursor, limit=limit, scan=scan, chars=chars)
        with conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(self.q[statement], params).fetchall()
        hits = [r for r in rows if r["hit"]]
        page = Page(hits[:limit])
        if len(hits) > limit:
            page.next_cursor = encode_cursor(f.mode, hits[limit - 1])
        elif f.id is None and rows and rows[-1]["n"] == params["scan"]:
            page.scanned_to = encode_cursor(f.mode, rows[-1])
        return page

    def matching(self, f: Filter, *, limit: int) -> tuple[list[tuple[int, str]], bool]:
        """(id, state) of up to ``limit`` tasks the filter matches, from the start of its order,
        and whether there may be more (the limit was reached, or the walk stopped after
        ``BULK_SCAN_ROWS`` rows)."""

        def read(conn: psycopg.Connection) -> tuple[list[tuple[int, str]], bool]:
            page = self._browse(conn, f, None, limit, BULK_SCAN_ROWS, chars=0)
            found = [(int(r["id"]), str(r["state"])) for r in page.rows]
            return found, bool(page.next_cursor or page.scanned_to)

        return self._run(read)

    # one task

    def task(self, task_id: int) -> dict[str, Any] | None:
        def read(conn: psycopg.Connection) -> dict[str, Any] | None:
            with conn.cursor(row_factory=dict_row) as cur:
                return cur.execute(self.q["console_task"], task_params(task_id)).fetchone()

        return self._run(read)

    # one workflow

    def workflow(
        self, workflow_id: int, *, after: int = 0, state: str | None = None
    ) -> WorkflowPage | None:
        """The workflow and the page of its steps after step ``after`` (only those in ``state``
        when given); None when there is no such workflow."""

        def read(conn: psycopg.Connection) -> WorkflowPage | None:
            with conn.cursor(row_factory=dict_row) as cur:
                head = cur.execute(self.q["console_workflow"], {"id": workflow_id}).fetchone()
                if head is None:
                    return None
                counts = cur.execute(
                    self.q["console_workflow_counts"], {"id": workflow_id}
                ).fetchall()
                steps = cur.execute(
                    self.q["console_workflow_steps"],
                    {
                        "id": workflow_id,
                        "after": after,
                        "state": state,
                        "limit": WORKFLOW_STEPS,
                        "deps": STEP_DEPS,
                        "deps_cap": STEP_DEPS_CAP,
                        "name_chars": ROW_NAME_CHARS,
                        "chars": ROW_CHARS,
                        "stored": STORED_BYTES,
                    },
                ).fetchall()
            more = len(steps) > WORKFLOW_STEPS
            steps = steps[:WORKFLOW_STEPS]
            return WorkflowPage(
                int(head["id"]),
                head["name"],
                head["created_at"],
                {r["state"]: int(r["n"]) for r in counts},
                min((r["first_started"] for r in counts if r["first_started"]), default=None),
                max((r["last_finished"] for r in counts if r["last_finished"]), default=None),
                steps,
                int(steps[-1]["id"]) if more else None,
            )

        return self._run(read)

    def download(self, task_id: int, what: str) -> IO[bytes] | None:
        """The task's ``what`` (payload, result or errors) as JSON text in UTF-8, in a file
        positioned at its start (in memory up to DOWNLOAD_MEMORY bytes, on disk beyond), or None
        when the task or the value is not there. Read from the database in chunks and at once,
        so that a slow client holds neither a connection nor a transaction open."""

        def read(conn: psycopg.Connection) -> IO[bytes] | None:
            params = download_params(task_id, what)
            there = conn.execute(self.q["console_download_exists"], params).fetchone()
            if not there or not there[0]:
                return None
            # Closed by whoever sends it (or below, when reading fails).
            out = tempfile.SpooledTemporaryFile(max_size=DOWNLOAD_MEMORY)  # noqa: SIM115
            try:
                with conn.cursor(name="console_download") as cur:
                    cur.itersize = 4
                    cur.execute(self.q["console_download"], params)
                    for expected, (n, chunk) in enumerate(cur):
                        if n != expected:
                            raise psycopg.DataError("the download's chunks came out of order")
                        out.write(chunk)
                out.seek(0)
                return out
            except BaseException:
                out.close()
                raise

        return self._run(read)

    # paused queues and the audit

    def paused(self) -> list[_pause.PausedQueue]:
        return self._run(lambda conn: _pause.paused(conn, self.schema))

    def recent_actions(self, limit: int = 20) -> list[tuple[Any, ...]]:
        return self._run(lambda conn: actions.recent(conn, self.schema, limit=limit))

    # actions

    def act(
        self,
        fn: Callable[[psycopg.Connection], actions.Outcome | bool],
        *,
        actor: str,
        address: str,
        action: str,
        target: Mapping[str, Any],
    ) -> actions.Outcome:
        """Run one action and record it in the audit table, in one transaction: an action that
        fails leaves no record, and a record that cannot be written undoes the action."""

        def run(conn: psycopg.Connection) -> actions.Outcome:
            result = fn(conn)
            if not isinstance(result, actions.Outcome):  # pause and resume say yes or no
                result = actions.Outcome(int(result))
            actions.record(
                conn,
                self.schema,
                actor=actor,
                address=address,
                action=action,
                target=target,
                affected=result.changed,
            )
            return result

        return self._run(run, write=True)


__all__ = [
    "MINUTE_CAP",
    "PAGE_ROWS",
    "SCAN_ROWS",
    "ConsoleData",
    "Minute",
    "Page",
    "Throughput",
    "Trends",
    "WorkflowPage",
    "first_line",
]
