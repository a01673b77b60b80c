"""Handlers for `worker demo`; also a short example of writing tasks.

Run them yourself with ``worker run worker.dev.demo_tasks``.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ..errors import DoNotRetry
from ..tasks.registry import Context, registry


@registry.task("demo.resize_image", queue="media")
def resize_image(payload: dict[str, Any]) -> None:
    """Stands for CPU or I/O work of a few milliseconds."""
    time.sleep(random.uniform(0.001, 0.005))


@registry.task("demo.send_email", max_attempts=5, retry_backoff=0.5)
def send_email(payload: dict[str, Any], ctx: Context) -> None:
    """Fails on its first attempt when asked to, to show a retry with backoff."""
    if payload.get("flaky") and ctx.attempt == 1:
        raise ConnectionError("SMTP server did not answer (demo: succeeds on retry)")
    if "@" not in payload.get("to", ""):
        raise DoNotRetry(f"not an email address: {payload.get('to')!r}")
