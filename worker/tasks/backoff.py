"""Retry delays: exponential in the attempt number, capped, with full jitter.

Jitter spreads retries of tasks that failed together (a database blip, an outage of a remote API)
so they do not come back as one thundering herd.
"""

from __future__ import annotations

import random

MAX_DELAY = 3600.0


def retry_delay(attempt: int, base: float, *, cap: float = MAX_DELAY) -> float:
    """Seconds to wait before attempt ``attempt + 1``: uniform in [d/2, d] for d = base * 2^(a-1).

    Half of the delay is kept fixed so a retry never comes back at once; the other half is random.
    """
    if base <= 0:
        return 0.0
    ceiling = min(cap, base * 2 ** max(attempt - 1, 0))
    return ceiling / 2 + random.random() * ceiling / 2
