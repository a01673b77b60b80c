"""Text fit for a terminal and for JSON: what producers wrote into rows (task and queue names,
errors) and what the driver says reaches the user without control sequences, at a bounded size,
and without passwords.

Control characters (C0 including tab and newline, DEL, C1), bidirectional overrides and lone
surrogates become visible escapes such as ``\\x1b``, so a row cannot clear the screen, retitle the
terminal or forge an output line; long text is cut with a marker saying how much was left out.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ..db.dsn import scrub

# Longest text of one table cell or line field, and of one JSON string.
CELL_LIMIT = 200
LINE_LIMIT = 2000
JSON_LIMIT = 64 * 1024
LOG_LIMIT = 16 * 1024

_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _marker(left_out: int) -> str:
    return f"...[{left_out} more chars]"


def safe(value: Any, limit: int = CELL_LIMIT) -> str:
    """``value`` as text for a terminal: control characters escaped, at most ``limit``
    characters (plus a marker saying how many were left out)."""
    text = "" if value is None else str(value)
    head = text[:limit]
    out = _UNSAFE.sub(_escape, head)
    if len(out) <= limit and len(text) <= limit:
        return out
    pieces: list[str] = []
    size = 0
    for ch in head:
        piece = _UNSAFE.sub(_escape, ch)
        if size + len(piece) > limit:
            break
        pieces.append(piece)
        size += len(piece)
    return "".join(pieces) + _marker(len(text) - len(pieces))


def safe_lines(text: str, limit: int = LINE_LIMIT) -> str:
    """Multi-line text (a traceback) with each line made safe; the line breaks stay."""
    return "\n".join(safe(line, limit) for line in text.split("\n"))


def bounded(value: Any, limit: int = JSON_LIMIT) -> Any:
    """JSON data with every string scrubbed of passwords and cut to ``limit`` characters (with a
    marker); json.dumps escapes control characters itself, so the rest stays exact."""
    if isinstance(value, str):
        text = scrub(value[:limit])
        return text + _marker(len(value) - limit) if len(value) > limit else text
    if isinstance(value, dict):
        return {bounded(k, limit): bounded(v, limit) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [bounded(v, limit) for v in value]
    return value


class SafeFormatter(logging.Formatter):
    """Log lines without passwords or control characters: a message is one line, however many
    newlines a task name or an error holds; a traceback keeps its lines, each made safe."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = safe(scrub(record.message), LOG_LIMIT)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return safe_lines(scrub(super().formatException(ei)))

    def formatStack(self, stack_info: str) -> str:
        return safe_lines(scrub(super().formatStack(stack_info)))


def quoted(name: str) -> str:
    """A name the user gave, quoted and cut to 80 characters, for a message."""
    return repr(name[:80] + ("..." if len(name) > 80 else ""))
