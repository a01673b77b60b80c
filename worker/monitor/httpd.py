"""A small HTTP server that stays bounded whatever its clients do.

The standard library's ThreadingHTTPServer starts a thread per connection and waits on a
client for ever: two hundred idle sockets held two hundred threads, and a client sending one
header byte a second held its thread as long as it liked. Here one thread (the loop) accepts
connections and reads their request heads without blocking; a connection costs a file descriptor
and a small buffer until its head is complete, and only then goes to one of a few handler
threads, which write the whole response and close it (one request per connection).

Limits: a request head must arrive within ``request_timeout`` (408 otherwise) and fit in
``max_head`` bytes, its request line in ``MAX_LINE`` (431 and 414); a body (the console's forms)
must say its length in Content-Length, at most ``max_body`` bytes (413), and arrive within the
same ``request_timeout`` (no chunked bodies: 501); at most ``max_connections`` connections wait
for their request (a new one pushes out the oldest with a 503); at most ``threads`` handler
threads, and at most ``MAX_QUEUED`` complete requests waiting for one (503 beyond). Every
response, errors included, carries ``SECURITY_HEADERS``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

log = logging.getLogger("worker.metrics")

# The status page: inline styles only, no scripts, no frames, no forms.
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
MAX_LINE = 8192  # bytes of the request line
MAX_HEAD = 16384  # bytes of the request line and headers together
MAX_BODY = 16384  # bytes of a request body
MAX_QUEUED = 64  # complete requests waiting for a handler thread
SECURITY_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Content-Security-Policy", CSP),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
)


def response(status: HTTPStatus, body: bytes, content_type: str, *, head: bool = False) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, for the loop to send as is."""
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        f"Date: {formatdate(usegmt=True)}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in SECURITY_HEADERS),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head else body)


def _plain(status: HTTPStatus, text: str) -> bytes:
    return response(status, f"{text}\n".encode(), "text/plain; charset=utf-8")


BUSY = _plain(HTTPStatus.SERVICE_UNAVAILABLE, "busy: too many connections, try again")
TIMEOUT = _plain(HTTPStatus.REQUEST_TIMEOUT, "request head not received in time")
LINE_TOO_LONG = _plain(HTTPStatus.REQUEST_URI_TOO_LONG, "request line too long")
HEAD_TOO_LONG = _plain(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request headers too large")
BODY_TOO_LONG = _plain(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request body too large")
BAD_LENGTH = _plain(HTTPStatus.BAD_REQUEST, "bad Content-Length")
NO_CHUNKS = _plain(HTTPStatus.NOT_IMPLEMENTED, "Transfer-Encoding is not accepted: send a length")


def body_length(head: bytes) -> int | bytes:
    """The body length a request head announces (0 without Content-Length), or the response
    that refuses it: several different lengths, a length that is not a number, or any
    Transfer-Encoding."""
    lengths = set()
    for line in head.split(b"\n")[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return NO_CHUNKS
        if name == b"content-length":
            lengths.add(value.strip())
    if not lengths:
        return 0
    if len(lengths) > 1:
        return BAD_LENGTH
    value = lengths.pop()
    if not value.isdigit():
        return BAD_LENGTH
    return int(value) if len(value) <= 12 else BODY_TOO_LONG


@dataclass
class _Conn:
    address: Any
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    need: int = -1  # once the head is in: the bytes of the head and the body together


class BoundedServer:
    """Serve ``handler(request=(socket, data), client_address, server)`` (a
    BaseHTTPRequestHandler that reads the request, head and body, from memory) until
    ``shutdown()``.

    ``inline`` may answer a request head at once on the loop (``None``: hand it to a thread),
    for responses that must never wait for a busy thread, such as a liveness probe.
    """

    def __init__(
        self,
        address: tuple[str, int],
        handler: Callable[..., Any],
        *,
        threads: int = 8,
        max_connections: int = 256,
        request_timeout: float = 10.0,
        max_head: int = MAX_HEAD,
        max_body: int = MAX_BODY,
        inline: Callable[[bytes], bytes | None] | None = None,
    ) -> None:
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.handler = handler
        self.threads = max(threads, 1)
        self.max_connections = max(max_connections, 1)
        self.request_timeout = request_timeout
        self.max_head = max_head
        self.max_body = max_body
        self.inline = inline
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ, "listen")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[socket.socket, _Conn] = {}  # oldest first
        self._queue: collections.deque[tuple[socket.socket, bytes, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._busy = 0  # handler threads running
        self._stopping = False
        self._stopped = threading.Event()

    # the loop

    def serve_forever(self, poll_interval: float = 0.25) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(timeout=poll_interval):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                self._expire()
        finally:
            for sock in list(self._conns):
                self._close(sock)
            self._selector.close()
            self.socket.close()
            self._wake_r.close()
            self._wake_w.close()
            self._stopped.set()

    def shutdown(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._stopped.wait(5)

    def _accept(self) -> None:
        for _ in range(64):  # then let the loop read and expire too
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: make room
                log.warning("metrics server: accept failed: %s", exc)
                if self._conns:
                    self._drop(next(iter(self._conns)), BUSY)
                return
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                self._drop(next(iter(self._conns)), BUSY)  # the oldest has had its chance
            self._conns[sock] = _Conn(address, time.monotonic() + self.request_timeout)
            self._selector.register(sock, selectors.EVENT_READ, "conn")

    def _read(self, sock: socket.socket) -> None:
        conn = self._conns.get(sock)
        if conn is None:
            return
        try:
            data = sock.recv(8192)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(sock)
            return
        buf = conn.buf
        buf += data
        if conn.need < 0:
            line_end = buf.find(b"\n")
            if line_end > MAX_LINE or (line_end < 0 and len(buf) > MAX_LINE):
                self._drop(sock, LINE_TOO_LONG)
                return
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                end += 4
            elif (end := buf.find(b"\n\n")) >= 0:
                end += 2
            if end < 0 or end > self.max_head:
                if end > self.max_head or len(buf) > self.max_head:
                    self._drop(sock, HEAD_TOO_LONG)
                return
            length = body_length(bytes(buf[:end]))
            if isinstance(length, bytes):
                self._drop(sock, length)
                return
            if length > self.max_body:
                self._drop(sock, BODY_TOO_LONG)
                return
            conn.need = end + length
        if len(buf) < conn.need:
            return  # the rest of the body, by the same deadline
        self._forget(sock)
        self._dispatch(sock, bytes(buf[: conn.need]), conn.address)

    def _expire(self) -> None:
        now = time.monotonic()
        for sock, conn in list(self._conns.items()):
            if conn.deadline > now:
                break  # deadlines grow with the order of arrival
            self._drop(sock, TIMEOUT)

    def _dispatch(self, sock: socket.socket, head: bytes, address: Any) -> None:
        quick = self.inline(head) if self.inline else None
        if quick is not None:
            self._send_now(sock, quick)
            return
        with self._lock:
            if self._busy < self.threads:
                self._busy += 1
            elif len(self._queue) < MAX_QUEUED:
                self._queue.append((sock, head, address))
                return
            else:
                quick = BUSY
        if quick is not None:
            self._send_now(sock, quick)
            return
        threading.Thread(
            target=self._work, args=(sock, head, address), name="worker-metrics-req", daemon=True
        ).start()

    # handler threads

    def _work(self, sock: socket.socket, head: bytes, address: Any) -> None:
        while True:
            try:
                sock.setblocking(True)
                sock.settimeout(self.request_timeout)  # sendall: a total for the response
                self.handler((sock, head), address, self)
            except Exception:
                log.exception("metrics server: request from %s failed", address)
            finally:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                sock.close()
            with self._lock:
                if not self._queue:
                    self._busy -= 1
                    return
                sock, head, address = self._queue.popleft()

    # sockets

    def _forget(self, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)

    def _close(self, sock: socket.socket) -> None:
        self._forget(sock)
        sock.close()

    def _send_now(self, sock: socket.socket, data: bytes) -> None:
        """Send a small response without blocking (a new socket's buffer takes it) and close."""
        with contextlib.suppress(OSError):
            sock.send(data)
            sock.shutdown(socket.SHUT_WR)
        sock.close()

    def _drop(self, sock: socket.socket, data: bytes) -> None:
        self._forget(sock)
        self._send_now(sock, data)


__all__ = ["MAX_BODY", "SECURITY_HEADERS", "BoundedServer", "body_length", "response"]
