"""Handlers for tests/test_hostile_rows.py (imported only by `worker run` processes)."""

from __future__ import annotations

from typing import Any

import worker


@worker.task("h.ok", max_attempts=1)
def ok(payload: Any) -> None:
    pass


@worker.task("h.nul", max_attempts=1)
def nul(payload: Any) -> None:
    """An error message no database text column can hold as it is."""
    raise ValueError("bad byte \x00 here and a lone surrogate \udc80 there")


@worker.task("h.echo", max_attempts=1)
def echo(payload: Any) -> None:
    """Fails with its payload in the message: whatever a producer wrote ends up in last_error."""
    raise RuntimeError(str(payload)[:10_000_000])
