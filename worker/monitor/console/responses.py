"""What the console answers with: its security headers, its static files, and ``Response``, which
the server writes out (``stream``: a body read from a file as it is sent, for downloads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus
from importlib import resources
from typing import IO

# Scripts and styles only from the console's own files; forms post only to this server.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Content-Security-Policy", CSP),
    ("X-Frame-Options", "DENY"),
    # Not no-referrer: with it, browsers send "Origin: null" on a POST, and the same-origin check
    # could not tell our own forms from anyone else's.
    ("Referrer-Policy", "same-origin"),
)
HTML = "text/html; charset=utf-8"
STATIC = {
    "/console/static/console.css": ("console.css", "text/css; charset=utf-8"),
    "/console/static/console.js": ("console.js", "text/javascript; charset=utf-8"),
}


@dataclass
class Response:
    status: HTTPStatus
    body: bytes
    content_type: str = HTML
    headers: list[tuple[str, str]] = field(default_factory=list)
    # A body too large to hold in memory: sent from this file (positioned at its start, of
    # ``length`` bytes), which the server closes once sent; ``body`` is then empty.
    stream: IO[bytes] | None = None
    length: int = 0


def static_files() -> dict[str, tuple[bytes, str]]:
    """The console's style sheet and script, by path: (content, type)."""
    files = resources.files("worker.monitor") / "static"
    return {path: ((files / name).read_bytes(), kind) for path, (name, kind) in STATIC.items()}


def redirect(location: str, *headers: tuple[str, str]) -> Response:
    return Response(HTTPStatus.SEE_OTHER, b"", headers=[("Location", location), *headers])


__all__ = ["CSP", "HEADERS", "HTML", "Response", "redirect", "static_files"]
