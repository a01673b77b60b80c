"""The monitor's HTTP server: /metrics, /healthz, /readyz, the status page at / and the operator
console under /console/.

One server per machine (the supervisor's, or the single worker process's). Everything it shows
comes from the cached read model (``readmodel.Database``) and the registry of ``collector``; the
console (``console.app``) has its own connections for job pages and actions.
Connections are handled by ``httpd.BoundedServer``: idle and slow clients cost no thread, and
/healthz is answered on its loop, so it never waits for the database or a busy thread.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import os
import shutil
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..errors import ConfigError
from ..tasks.registry import registry
from .console.app import Console
from .console.auth import ConsoleAuth
from .console.data import ConsoleData
from .console.responses import HEADERS as CONSOLE_HEADERS
from .httpd import SECURITY_HEADERS, BoundedServer, response
from .metrics.collector import build_registry, child_exited, prepare_multiprocess_dir
from .metrics.instruments import (
    COUNT_CAP_ENV,
    DEFAULT_COUNT_CAP,
    DEFAULT_TTL,
    MULTIPROC_ENV,
    TTL_ENV,
    UNREGISTERED,
    instruments,
)
from .metrics.journal import journal_paths, settle
from .page.render import render_page
from .readmodel import Database

log = logging.getLogger("worker.metrics")

# -- HTTP ------------------------------------------------------------------------------------------


HEALTHZ = b"ok\n"


def healthz(head: bytes) -> bytes | None:
    """/healthz, answered on the server's loop: the process is alive when its loop is."""
    method, _, rest = head.partition(b" ")
    target = rest.partition(b" ")[0]
    if method in (b"GET", b"HEAD") and urlsplit(target.decode("latin-1")).path == "/healthz":
        plain = "text/plain; charset=utf-8"
        return response(HTTPStatus.OK, HEALTHZ, plain, head=method == b"HEAD")
    return None


def _page_number(query: str) -> int:
    try:
        return int(parse_qs(query).get("queues_page", ["1"])[0])
    except ValueError:
        return 1


class _Handler(BaseHTTPRequestHandler):
    """One request, whose head ``BoundedServer`` has read: the response is written to memory and
    sent with one ``sendall`` (bounded by the socket's timeout), then the connection closes."""

    server_version = "worker-metrics"
    default_request_version = "HTTP/1.0"  # never answer in HTTP/0.9, which has no headers
    protocol_version = "HTTP/1.1"
    db: Database
    registry: Any
    console: Console

    def setup(self) -> None:
        self.connection, head = self.request
        self.rfile = io.BytesIO(head)
        self.wfile = io.BytesIO()

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.sendall(self.wfile.getvalue())

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors the request parser finds (400, 414, 501, 505) as short text, with the same
        headers as every other response (the default is an HTML page without them)."""
        status = HTTPStatus(code)
        body = f"{status.value} {message or status.phrase}\n".encode("utf-8", "replace")
        head = getattr(self, "command", "") == "HEAD"
        self._send(status, body, "text/plain; charset=utf-8", head)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if not _is_console(path):
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, "Unsupported method ('POST')")
            return
        try:
            body = self.rfile.read()  # the loop read exactly the announced length, bounded
            address = str(self.client_address[0]) if self.client_address else "?"
            self._answer(self.console.post(path, body, self.headers, address), head=False)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:
            log.exception("console: POST %s failed", path[:100])
            with contextlib.suppress(Exception):
                self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    b"internal error (see the worker's log)\n",
                    "text/plain; charset=utf-8",
                    False,
                    CONSOLE_HEADERS,
                )

    def _answer(self, r: Any, *, head: bool) -> None:
        self._send(r.status, r.body, r.content_type, head, CONSOLE_HEADERS, r.headers)

    def _route(self, *, head: bool) -> None:
        url = urlsplit(self.path)
        path = url.path
        try:
            if path == "/metrics":
                self._metrics(head)
            elif path == "/healthz":  # normally answered by healthz() on the loop
                self._send(HTTPStatus.OK, HEALTHZ, "text/plain; charset=utf-8", head)
            elif path == "/readyz":
                ok, why = self.db.ready()
                status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
                self._send(status, f"{why}\n".encode(), "text/plain; charset=utf-8", head)
            elif _is_console(path):
                self._answer(self.console.get(path, url.query, self.headers), head=head)
            elif path in ("/", "/index.html"):
                page = self.db.page()
                body = render_page(
                    page,
                    schema=self.db.schema,
                    dsn=self.db.display_dsn,
                    expected_version=self.db.expected_version,
                    ttl=self.db.ttl,
                    queues_page=_page_number(url.query),
                )
                status = HTTPStatus.SERVICE_UNAVAILABLE if page.error else HTTPStatus.OK
                self._send(status, body.encode(), "text/html; charset=utf-8", head)
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8", head)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:
            log.exception("metrics server: %s failed", path)
            with contextlib.suppress(Exception):
                self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    b"internal error (see the worker's log)\n",
                    "text/plain; charset=utf-8",
                    head,
                )

    def _metrics(self, head: bool) -> None:
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        body = encoder(self.registry)
        self._send(HTTPStatus.OK, body, content_type, head)

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        head: bool,
        security: tuple[tuple[str, str], ...] = SECURITY_HEADERS,
        extra: list[tuple[str, str]] | None = None,
    ) -> None:
        encoding = None
        headers = getattr(self, "headers", None)  # None when the request did not parse
        if len(body) > 1024 and headers and "gzip" in headers.get("Accept-Encoding", ""):
            body = gzip.compress(body, compresslevel=5)
            encoding = "gzip"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for name, value in (*security, *(extra or ())):
            self.send_header(name, value)
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _is_console(path: str) -> bool:
    return path == "/console" or path.startswith("/console/")


class WebServer:
    """A ``BoundedServer`` whose loop runs on a daemon thread; ``stop()`` shuts it down."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: Database,
        registry: Any,
        console: Console,
        **limits: Any,
    ) -> None:
        handler = type("Handler", (_Handler,), {"db": db, "registry": registry, "console": console})
        try:
            self.httpd = BoundedServer((host, port), handler, inline=healthz, **limits)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} "
                "(is another process using --metrics-port?)"
            ) from None
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="worker-metrics-http",
            daemon=True,
        )
        self.thread.start()
        log.info(
            "serving /metrics, /healthz, /readyz, the status page and the console (%s) on %s",
            "actions on" if console.auth.enabled else "read-only",
            self.url,
        )

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.thread.join(timeout=5)


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value >= 0 else default


class MetricsServer:
    """What ``serve`` returns: the running HTTP server and what it owns."""

    def __init__(
        self,
        web: WebServer,
        db: Database,
        multiprocess_dir: str | None,
        previous_env: str | None = None,
        *,
        dsn: str = "",
        schema: str = "worker",
        console: Console | None = None,
    ) -> None:
        self.web = web
        self.db = db
        self.console = console
        self.multiprocess_dir = multiprocess_dir
        self._previous_env = previous_env
        self._dsn = dsn
        self._schema = schema

    def child_exited(self, pid: int) -> None:
        """The supervisor's callback for a child that is gone, however it went: drop its live
        gauges now, and settle its journal in the background (that may wait for the database)."""
        path = self.multiprocess_dir
        if not path:
            return
        child_exited(pid, path)
        if any(os.path.exists(p) for p in journal_paths(path, pid)):
            threading.Thread(
                target=self._settle, args=(pid, path), name=f"settle-{pid}", daemon=True
            ).start()

    def handed_back(self, rows: list[tuple[int, str, str, str]]) -> None:
        """The supervisor's callback for a dead child's rows it handed back: they count as
        rescued, and as failed when that was their last attempt (as a lease rescue would)."""
        m = instruments()
        for _id, queue, task, state in rows:
            key = (queue, task if registry.get(task) is not None else UNREGISTERED)
            m.rescued.labels(*key).inc()
            if state == "failed":
                m.failed.labels(*key).inc()

    def _settle(self, pid: int, path: str) -> None:
        try:
            settle(pid, path, self._dsn, self._schema)
        except Exception:
            log.exception("could not settle the metrics of worker pid %d", pid)

    @property
    def port(self) -> int:
        return self.web.port

    @property
    def url(self) -> str:
        return self.web.url

    def stop(self) -> None:
        self.web.stop()
        if self.console is not None:
            self.console.close()
        self.db.close()
        if self.multiprocess_dir:
            shutil.rmtree(self.multiprocess_dir, ignore_errors=True)
            if os.environ.get(MULTIPROC_ENV) == self.multiprocess_dir:
                _restore_env(self._previous_env)
            self.multiprocess_dir = None


def serve(
    host: str,
    port: int,
    *,
    dsn: str,
    schema: str,
    multiprocess: bool = False,
    ttl: float | None = None,
    count_cap: int | None = None,
    console_token: str | None = None,
    console_refresh: float = 5.0,
    **limits: Any,
) -> MetricsServer:
    """Serve /metrics, /healthz, /readyz, the status page at ``/`` and the console under
    ``/console/`` until ``stop()``.

    ``multiprocess``: this process is a supervisor whose children do the work; call it before the
    first child starts, so that they inherit a fresh PROMETHEUS_MULTIPROC_DIR.
    ``console_token``: the token that turns the console's actions on (None: read-only; see
    ``console.auth.checked_token``); ``console_refresh``: seconds between the console's
    auto-refreshes. ``limits``: ``BoundedServer``'s (threads, max_connections, request_timeout,
    max_head, max_body).
    """
    db = Database(
        dsn,
        schema,
        ttl=_env_float(TTL_ENV, DEFAULT_TTL) if ttl is None else ttl,
        count_cap=count_cap or int(_env_float(COUNT_CAP_ENV, DEFAULT_COUNT_CAP)) or 1,
    )
    previous = os.environ.get(MULTIPROC_ENV)
    path = prepare_multiprocess_dir() if multiprocess else None
    console = Console(
        db,
        ConsoleData(dsn, schema, ttl=db.ttl),
        ConsoleAuth(console_token),
        refresh=console_refresh,
    )
    try:
        registry = build_registry(db, multiprocess_dir=path)
        web = WebServer(host, port, db=db, registry=registry, console=console, **limits)
    except BaseException:
        console.close()
        db.close()
        if path:
            shutil.rmtree(path, ignore_errors=True)
            _restore_env(previous)
        raise
    return MetricsServer(web, db, path, previous, dsn=dsn, schema=schema, console=console)


def _restore_env(previous: str | None) -> None:
    if previous is None:
        os.environ.pop(MULTIPROC_ENV, None)
    else:
        os.environ[MULTIPROC_ENV] = previous


__all__ = ["MetricsServer", "WebServer", "serve"]
