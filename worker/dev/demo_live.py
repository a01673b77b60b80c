"""The handlers of `worker demo` and, when it runs until Ctrl-C, a cron job.

``worker demo --tasks N`` runs :mod:`worker.dev.demo_tasks` alone, so that its N tasks settle
without a cron run among them. Run these yourself with ``worker run worker.dev.demo_live``.
"""

from __future__ import annotations

from typing import Any

from ..coord.schedule import cron
from . import demo_tasks

__all__ = ["demo_tasks", "tidy"]

# A sixth field is seconds (croniter): every 5 seconds, so a short demo shows a few runs.
TIDY_EVERY = "* * * * * */5"


# catch_up="skip": slots missed while the demo was stopped are not run at its next start (they
# would count as that run's).
@cron(TIDY_EVERY, name="demo.tidy", queue="maintenance", catch_up="skip")
def tidy(payload: dict[str, Any]) -> None:
    """Stands for a periodic clean-up; each slot runs once however many workers offer it."""
