"""The types of the ``worker`` command's flags, and its parser: a bad flag is one clear line.
Nothing here touches the database, so the parser is built before any command module loads."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, NoReturn

from ..db.sql import validate_schema_name
from ..errors import ConfigError
from .text import LINE_LIMIT, safe


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage block) and exit 2; options are
    never abbreviated (``--ds`` for ``--dsn`` would slip past the code that hides DSNs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {safe(message, LINE_LIMIT)} (see --help)")


class UsageError(Exception):
    """A flag the parser refused: ``line`` is what the user sees (exit 2)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def int_in(low: int, high: int) -> Callable[[str], int]:
    """A flag type: a whole number from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {value}")
        return value

    return parse


def seconds_in(low: float, high: float) -> Callable[[str], float]:
    """A flag type: a number of seconds from ``low`` to ``high`` (no NaN, no infinity)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low:g} to {high:g} seconds, got {text}")
        return value

    return parse


def rate_in(low: float, high: float) -> Callable[[str], float]:
    """A flag type: a number of tasks per second from ``low`` to ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected tasks per second, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected {low:g} to {high:g} tasks per second, got {text}"
            )
        return value

    return parse


def text_up_to(limit: int) -> Callable[[str], str]:
    """A flag type: 1 to ``limit`` characters, none of them NUL (a text column cannot hold it)."""

    def parse(text: str) -> str:
        if not text or len(text) > limit or "\x00" in text:
            raise argparse.ArgumentTypeError(f"expected 1 to {limit} characters, no NUL")
        return text

    return parse


DAY = 86400.0
seconds = seconds_in(0, 10 * 365 * DAY)


def schema_name(text: str) -> str:
    try:
        return validate_schema_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


TASK_ID = int_in(1, 2**63 - 1)

# Flag ranges: the schema's for task fields, and what one machine can sensibly run.
MAX_PROCESSES = max(64, 4 * (os.cpu_count() or 1))
PRIORITY = int_in(-1_000_000, 1_000_000)
ATTEMPTS = int_in(1, 1_000_000)


def common_flags() -> Parser:
    """The flags every command takes (a parent parser)."""
    common = Parser(add_help=False)
    common.add_argument(
        "--dsn",
        help="PostgreSQL URL or conninfo (default: $WORKER_DSN, "
        "$DATABASE_URL, else the embedded server)",
    )
    common.add_argument(
        "--schema",
        type=schema_name,
        default=os.environ.get("WORKER_SCHEMA", "worker"),
        help="schema holding the queue tables (default: $WORKER_SCHEMA, else worker; "
        "`worker demo`: worker_demo)",
    )
    common.add_argument(
        "--log-level",
        default=os.environ.get("WORKER_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    return common
