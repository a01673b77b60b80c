"""What the console answers with: its security headers, its static files, and ``Response``, which
the server writes out (``stream``: a body read from a file as it is sent, for downloads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from importlib import resources
from typing import IO, Any

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
JSON = "application/json"
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


class _Releasing:
    """A file whose ``close`` also calls ``release`` (once)."""

    def __init__(self, file: IO[bytes], release: Callable[[], None]) -> None:
        self._file = file
        self._release: Callable[[], None] | None = release

    def read(self, n: int = -1) -> bytes:
        return self._file.read(n)

    def close(self) -> None:
        try:
            self._file.close()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()

    def __enter__(self) -> _Releasing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def attachment(name: str, body: IO[bytes], release: Callable[[], None]) -> Response:
    """``body`` (a file positioned at its start) as a JSON file to save as ``name``; ``release``
    is called once the server has sent it and closed it."""
    length = body.seek(0, 2)
    body.seek(0)
    disposition = ("Content-Disposition", f'attachment; filename="{name}"')
    stream: Any = _Releasing(body, release)
    return Response(HTTPStatus.OK, b"", JSON, [disposition], stream=stream, length=length)


def redirect(location: str, *headers: tuple[str, str]) -> Response:
    return Response(HTTPStatus.SEE_OTHER, b"", headers=[("Location", location), *headers])


__all__ = ["CSP", "HEADERS", "HTML", "JSON", "Response", "attachment", "redirect", "static_files"]
