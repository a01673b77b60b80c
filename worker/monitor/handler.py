"""One request to the monitor's server: which of /metrics, /healthz, /readyz, the status page and
the console it names, and its response.

The status page and the console answer only requests whose ``Host`` names this server
(``hosts.HostCheck``; 421 otherwise), so that a page on another site cannot read them through a
browser by DNS rebinding. A console response with a ``stream`` (a download) is sent from its file
as it is read, never held in memory whole.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from .bounds import clip
from .console.app import Console
from .console.responses import HEADERS as CONSOLE_HEADERS
from .console.responses import Response
from .hosts import HostCheck
from .httpd import SECURITY_HEADERS, response
from .readmodel import Database

log = logging.getLogger("worker.metrics")

PLAIN = "text/plain; charset=utf-8"
CHUNK = 256 * 1024  # bytes of a download sent at a time
MISDIRECTED = (
    b"421 Misdirected Request: this server does not answer for that host name (its operator can "
    b"allow it with --console-host)\n"
)
MAX_LOGGED_HOSTS = 100  # refused host names a server logs (once each), at most
_logged_lock = threading.Lock()

HEALTHZ = b"ok\n"


def healthz(head: bytes) -> bytes | None:
    """/healthz, answered on the server's loop: the process is alive when its loop is."""
    method, _, rest = head.partition(b" ")
    target = rest.partition(b" ")[0]
    if method in (b"GET", b"HEAD") and urlsplit(target.decode("latin-1")).path == "/healthz":
        plain = PLAIN
        return response(HTTPStatus.OK, HEALTHZ, plain, head=method == b"HEAD")
    return None


class Handler(BaseHTTPRequestHandler):
    """One request, whose head ``BoundedServer`` has read: the response is written to memory and
    sent with one ``sendall`` (bounded by the socket's timeout), then the connection closes."""

    server_version = "worker-metrics"
    default_request_version = "HTTP/1.0"  # never answer in HTTP/0.9, which has no headers
    protocol_version = "HTTP/1.1"
    db: Database
    registry: Any
    console: Console
    hosts: HostCheck
    refused_hosts: set[str]  # the server's: host names refused and logged

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
        self._send(status, body, PLAIN, head)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if not _is_console(path):
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, "Unsupported method ('POST')")
            return
        if not self._host_ok(head=False):
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
                    PLAIN,
                    False,
                    CONSOLE_HEADERS,
                )

    def _answer(self, r: Response, *, head: bool) -> None:
        if r.stream is None:
            self._send(r.status, r.body, r.content_type, head, CONSOLE_HEADERS, r.headers)
            return
        with r.stream:
            self.send_response(r.status)
            for name, value in (
                ("Content-Type", r.content_type),
                ("Content-Length", str(r.length)),
                ("Connection", "close"),
                *CONSOLE_HEADERS,
                *r.headers,
            ):
                self.send_header(name, value)
            self.end_headers()
            try:
                self.connection.sendall(self.wfile.getvalue())
                # Each chunk within the socket's timeout: a client that stops reading is dropped.
                while not head and (chunk := r.stream.read(CHUNK)):
                    self.connection.sendall(chunk)
            except OSError as exc:
                log.debug("a download to %s stopped: %s", self.client_address, exc)
            self.wfile = io.BytesIO()  # sent, or given up: finish() has nothing more to send

    def _host_ok(self, *, head: bool) -> bool:
        """Whether the request's Host names this server; if not, answered with 421."""
        given = self.headers.get_all("Host") or []
        host = given[0] if len(given) == 1 else None  # none, or several: which would be meant?
        if self.hosts.allows(host):
            return True
        shown = clip(host or f"({len(given)} Host headers)", 100)
        with _logged_lock:
            logged = self.refused_hosts
            first = shown not in logged and len(logged) < MAX_LOGGED_HOSTS
            if first:
                logged.add(shown)
        if first:
            log.warning(
                "refused a request for Host %s from %s: not a name of this server (allow it "
                "with --console-host); further ones are not logged",
                shown,
                self.client_address[0] if self.client_address else "?",
            )
        self._send(HTTPStatus.MISDIRECTED_REQUEST, MISDIRECTED, PLAIN, head)
        return False

    def _route(self, *, head: bool) -> None:
        url = urlsplit(self.path)
        path = url.path
        try:
            if path == "/metrics":
                self._metrics(head)
            elif path == "/healthz":  # normally answered by healthz() on the loop
                self._send(HTTPStatus.OK, HEALTHZ, PLAIN, head)
            elif path == "/readyz":
                ok, why = self.db.ready()
                status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
                self._send(status, f"{why}\n".encode(), PLAIN, head)
            elif (_is_console(path) or path in ("/", "/index.html")) and not self._host_ok(
                head=head
            ):
                return
            elif _is_console(path):
                self._answer(self.console.get(path, url.query, self.headers), head=head)
            elif path in ("/", "/index.html"):
                # The console's overview, read-only, with the status page's headers (no script).
                r = self.console.status_page(url.query)
                self._send(r.status, r.body, r.content_type, head)
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", PLAIN, head)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:
            log.exception("metrics server: %s failed", path)
            with contextlib.suppress(Exception):
                self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    b"internal error (see the worker's log)\n",
                    PLAIN,
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


__all__ = ["HEALTHZ", "Handler", "healthz"]
