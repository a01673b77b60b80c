"""The operator console under /console: which page or action a request names, who may do it, and
the record of every action (the log, and the audit table through ``ConsoleData.act``). It also
renders the status page at / (``status_page``): its overview without the actions.

Reads need nothing. Every POST is refused (403) unless actions are on (a console token is
configured), the request comes from a page of this server (Origin matches Host), it belongs to a
signed-in session and it carries that session's CSRF token. A refused POST changes nothing.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any, TypeVar
from urllib.parse import parse_qs

import psycopg

from ...db.dsn import scrub
from ...ops import actions
from ..bounds import clip
from ..page.overview import Overview
from ..page.render import render_page
from ..readmodel import Database
from . import jobs as console_jobs
from . import views as console_views
from . import workflow as console_workflow
from .acts import Acts
from .auth import ConsoleAuth, Session, clear_cookie, csrf_ok, same_origin, set_cookie
from .data import ConsoleData, first_line
from .filter import parse_filter
from .responses import HEADERS, Response, attachment, redirect, static_files
from .throttle import retry_after
from .views import Frame

log = logging.getLogger("worker.console")

T = TypeVar("T")

MAX_FORM_FIELDS = 20
RETRY = ("Retry-After", "5")
_TASK_ACTION = re.compile(r"/console/jobs/([0-9]{1,19})/(retry|cancel|delete)")
_TASK_PAGE = re.compile(r"/console/jobs/([0-9]{1,19})")
_WORKFLOW_PAGE = re.compile(r"/console/workflows/([0-9]{1,19})")
_WORKFLOW_ACTION = re.compile(r"/console/workflows/([0-9]{1,19})/(cancel|retry)")
_DOWNLOAD = re.compile(r"/console/jobs/([0-9]{1,19})/(payload|result|errors)\.json")
DOWNLOADS = 2  # downloads read from the database or sent at the same time, at most


def _first(form: Mapping[str, list[str]], key: str) -> str:
    return (form.get(key) or [""])[0]


class Console(Acts):
    def __init__(
        self, db: Database, data: ConsoleData, auth: ConsoleAuth, *, refresh: float = 5.0
    ) -> None:
        self.db = db
        self.data = data
        self.auth = auth
        self.refresh = refresh
        self.schema = db.schema
        self._files = static_files()
        self._downloads = threading.BoundedSemaphore(DOWNLOADS)

    def close(self) -> None:
        self.data.close()

    def _frame(self, session: Session | None, *, keep_flash: bool = False) -> Frame:
        flash: list[str] = []
        if session is not None and not keep_flash:
            flash, session.flash = session.flash, []
        return Frame(
            self.schema, self.db.display_dsn, self.refresh, self.auth.enabled, session, flash
        )

    def _html(self, body: str, status: HTTPStatus = HTTPStatus.OK) -> Response:
        return Response(status, body.encode())

    def _safe(self, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except psycopg.Error as exc:
            log.warning("console: database problem: %s", scrub(first_line(exc)))
            return default

    # GET

    def get(self, path: str, query: str, headers: Mapping[str, str]) -> Response:
        if path in self._files:
            body, kind = self._files[path]
            return Response(HTTPStatus.OK, body, kind)
        session = self.auth.session(headers)
        # The page's own refreshes leave messages for the next page the person opens.
        frame = self._frame(session, keep_flash=bool(headers.get("X-Console-Refresh")))
        params = parse_qs(query, max_num_fields=MAX_FORM_FIELDS)
        try:
            return self._get(path, params, frame)
        except psycopg.Error as exc:
            text = f"database problem: {scrub(first_line(exc))}"
            page = console_views.message(frame, "Database problem", text)
            return self._html(page, HTTPStatus.SERVICE_UNAVAILABLE)

    def overview(self, queues_page: int) -> Overview:
        """What the overview shows, the console's and the status page's alike."""
        return Overview(
            self.db.page(),
            self.data.throughput(),
            self.data.trends(),
            self._safe(self.data.paused, []),
            self._safe(lambda: self.data.recent_actions(10), []),
            queues_page,
        )

    def status_page(self, query: str) -> Response:
        """The status page at /: the overview, read-only, without a script (served with the
        status page's own Content-Security-Policy, which allows none)."""
        try:
            number = _page_number(parse_qs(query, max_num_fields=MAX_FORM_FIELDS))
        except ValueError:  # more fields than a page of this console takes
            number = 1
        o = self.overview(number)
        body = render_page(
            o,
            schema=self.schema,
            dsn=self.db.display_dsn,
            expected_version=self.db.expected_version,
            ttl=self.db.ttl,
        )
        return self._html(body, _status(o.page))

    def _get(self, path: str, params: Mapping[str, list[str]], frame: Frame) -> Response:
        if path in ("/console", "/console/"):
            o = self.overview(_page_number(params))
            body = console_views.overview(
                frame, o, expected_version=self.db.expected_version, ttl=self.db.ttl
            )
            return self._html(body, _status(o.page))
        if path == "/console/jobs":
            f, notes = parse_filter(params)
            cursor = _first(params, "cursor") or None
            page = self.data.browse(f, cursor)
            status = HTTPStatus.SERVICE_UNAVAILABLE if page.error else HTTPStatus.OK
            return self._html(console_jobs.browser(frame, f, page, notes, cursor), status)
        if path == "/console/jobs/bulk":
            return self._bulk_page(params, frame)
        if match := _DOWNLOAD.fullmatch(path):
            return self._download(frame, int(match.group(1)), match.group(2))
        if match := _TASK_PAGE.fullmatch(path):
            task_id = int(match.group(1))
            task = self.data.task(task_id) if task_id < 2**63 else None
            status = HTTPStatus.OK if task else HTTPStatus.NOT_FOUND
            return self._html(console_jobs.detail(frame, task, task_id), status)
        if match := _WORKFLOW_PAGE.fullmatch(path):
            return self._workflow_page(frame, int(match.group(1)), params)
        if path == "/console/queues":
            page = self.db.page()
            paused = self._safe(self.data.paused, [])
            body = console_views.queues(frame, page, paused, _page_number(params))
            return self._html(body, _status(page))
        if path in ("/console/cron", "/console/locks"):
            page = self.db.page()
            view = console_views.cron if path.endswith("cron") else console_views.locks
            return self._html(view(frame, page), _status(page))
        if path == "/console/login":
            return self._html(console_views.sign_in(frame))
        return self._html(
            console_views.message(frame, "Not found", "No such console page."),
            HTTPStatus.NOT_FOUND,
        )

    def _workflow_page(
        self, frame: Frame, workflow_id: int, params: Mapping[str, list[str]]
    ) -> Response:
        state = _first(params, "state") or None
        if state not in (None, *console_workflow.STEP_STATES):
            state = None
        after = _first(params, "after")
        start = int(after) if after.isdigit() and int(after) < 2**63 else 0
        wf = None
        if workflow_id < 2**63:
            wf = self.data.workflow(workflow_id, after=start, state=state)
        status = HTTPStatus.OK if wf else HTTPStatus.NOT_FOUND
        return self._html(console_workflow.page(frame, wf, workflow_id, state, start), status)

    def _download(self, frame: Frame, task_id: int, what: str) -> Response:
        """The whole payload, result or error history of a task, as a JSON file, read like its
        page (no sign-in), sent as it is read (the server closes the file)."""
        if not self._downloads.acquire(blocking=False):
            text = "other downloads are being sent: try again in a moment"
            page = console_views.message(frame, "Busy", text)
            return Response(HTTPStatus.SERVICE_UNAVAILABLE, page.encode(), headers=[RETRY])
        try:
            found = self.data.download(task_id, what) if task_id < 2**63 else None
        except BaseException:
            self._downloads.release()
            raise
        if found is None:
            self._downloads.release()
            text = f"Task {task_id} has no {what} (or is gone)."
            page = console_views.message(frame, "Not found", text)
            return self._html(page, HTTPStatus.NOT_FOUND)
        # The slot is free again once the file is sent and closed.
        return attachment(f"task-{task_id}-{what}.json", found, self._downloads.release)

    def _bulk_page(self, params: Mapping[str, list[str]], frame: Frame) -> Response:
        action = _first(params, "action")
        f, _ = parse_filter(params)
        if action not in console_jobs.BULK or f.empty or f.id is not None:
            text = "a bulk action needs an action (retry, cancel or delete) and a filter"
            return self._html(
                console_views.message(frame, "Bad request", text), HTTPStatus.BAD_REQUEST
            )
        if not frame.can_act:
            text = "sign in to act on tasks" if self.auth.enabled else "actions are off"
            return self._html(console_views.message(frame, "Read-only", text), HTTPStatus.FORBIDDEN)
        found, more = self.data.matching(f, limit=actions.MAX_IDS)
        body = console_jobs.bulk_confirm(frame, f, action, found, more, actions.MAX_IDS)
        return self._html(body)

    # POST

    def post(self, path: str, body: bytes, headers: Mapping[str, str], address: str) -> Response:
        frame = self._frame(None)
        if not self.auth.enabled:
            return self._refuse(frame, "actions are off: no console token is configured")
        if not same_origin(headers):
            log.warning(
                "console: refused a POST to %s from %s: not from this console's pages",
                clip(path, 100),
                address,
            )
            return self._refuse(frame, "refused: this request did not come from this console")
        kind = (headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            return self._refuse(
                frame, "refused: expected a form", HTTPStatus.UNSUPPORTED_MEDIA_TYPE
            )
        try:
            form = parse_qs(
                body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS
            )
        except (UnicodeDecodeError, ValueError):
            return self._refuse(
                frame, "refused: a form this console cannot read", HTTPStatus.BAD_REQUEST
            )
        if path == "/console/login":
            return self._sign_in(form, address)
        session = self.auth.session(headers)
        if session is None:
            return self._refuse(frame, "refused: sign in first")
        if not csrf_ok(session, _first(form, "csrf")):
            log.warning(
                "console: refused a POST to %s from %s: missing or wrong CSRF token",
                clip(path, 100),
                address,
            )
            return self._refuse(frame, "refused: missing or wrong CSRF token (reload the page)")
        if path == "/console/logout":
            self.auth.sign_out(session)
            log.info("console: %s signed out (from %s)", clip(session.name, 64), address)
            return redirect("/console/", ("Set-Cookie", clear_cookie()))
        who = (session.name, address)
        if match := _TASK_ACTION.fullmatch(path):
            return self._task_action(session, who, int(match.group(1)), match.group(2))
        if path == "/console/jobs/bulk":
            return self._bulk(session, who, form)
        if match := _WORKFLOW_ACTION.fullmatch(path):
            workflow_id, verb = int(match.group(1)), match.group(2)
            return self._workflow_action(session, who, workflow_id, verb, form)
        if path in ("/console/queues/pause", "/console/queues/resume"):
            return self._queue_action(session, who, path.rsplit("/", 1)[1], _first(form, "queue"))
        return self._refuse(frame, "no such action", HTTPStatus.NOT_FOUND)

    def _refuse(
        self, frame: Frame, text: str, status: HTTPStatus = HTTPStatus.FORBIDDEN
    ) -> Response:
        return self._html(console_views.message(frame, "Refused", text), status)

    def _sign_in(self, form: Mapping[str, list[str]], address: str) -> Response:
        # Failures are logged by the throttle: a few lines per burst, not one per attempt.
        outcome = self.auth.sign_in(_first(form, "token"), _first(form, "name"), address)
        session = outcome.session
        if session is None:
            text = "Wrong token." if outcome.checked else ""
            if not outcome.retry_after:
                return self._html(
                    console_views.sign_in(self._frame(None), text), HTTPStatus.FORBIDDEN
                )
            wait = retry_after(outcome.retry_after)
            text += f" Too many failed sign-ins from your address: try again in {wait} s."
            page = console_views.sign_in(self._frame(None), text.strip())
            return Response(
                HTTPStatus.TOO_MANY_REQUESTS, page.encode(), headers=[("Retry-After", wait)]
            )
        log.info("console: %s signed in from %s", clip(session.name, 64), address)
        return redirect("/console/", ("Set-Cookie", set_cookie(session)))


def _page_number(params: Mapping[str, list[str]]) -> int:
    try:
        return int(_first(params, "queues_page") or 1)
    except ValueError:
        return 1


def _status(page: Any) -> HTTPStatus:
    return HTTPStatus.SERVICE_UNAVAILABLE if page.error else HTTPStatus.OK


__all__ = ["HEADERS", "Console", "Response"]
