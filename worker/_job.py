"""One claimed task inside a worker process, as a small state machine.

    claimed ──▶ running ──▶ finished ──▶ acking ──▶ (gone: acknowledged)
                   │            ▲            │
                   ▼            │            └──▶ finished (the acknowledgement rolled back)
                overdue ────────┘  (a handler past its timeout; its thread came back)

    any state but acking ──▶ lost      (the lease thread found the row is no longer ours)
    claimed | running   ──▶ released   (a graceful stop handed it back)

The main thread moves a job between these states; the lease thread only reads them (which rows
to renew) and sets ``lost``. A job leaves the worker's table only once its row is acknowledged,
handed back, or lost, so a graceful stop knows exactly what it still holds.
"""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass, field

from ._registry import TaskDef
from ._transitions import Claimed

MAX_ERROR_CHARS = 4000


class State(enum.Enum):
    CLAIMED = "claimed"  # waiting for a runner thread
    RUNNING = "running"  # a runner thread has it
    OVERDUE = "overdue"  # running past its timeout; its thread is written off, its lease kept
    FINISHED = "finished"  # the outcome is here, not yet acknowledged
    ACKING = "acking"  # inside the acknowledging transaction


# States whose rows the lease thread keeps renewing.
LEASED = frozenset({State.CLAIMED, State.RUNNING, State.OVERDUE, State.FINISHED})


@dataclass(slots=True)
class Outcome:
    """What running a handler came to, as a plain value: no I/O happens where it is made."""

    token: int
    ok: bool
    error: str | None = None
    permanent: bool = False
    duration: float = 0.0
    acked: bool = False  # transactional handlers complete their row themselves
    runner: int = -1  # which runner thread produced it


@dataclass(slots=True)
class Job:
    token: int
    claimed: Claimed
    definition: TaskDef
    dispatched: float
    deadline: float | None
    state: State = State.CLAIMED
    lost: bool = False
    runner: int = -1  # the runner thread running it (RUNNING and OVERDUE)
    outcome: Outcome | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def id(self) -> int:
        return self.claimed.id

    @property
    def attempt(self) -> int:
        return self.claimed.attempt


def format_error(exc: BaseException, *, frames: int = 5) -> str:
    """``Type: message`` then the last few traceback frames: enough to find the line, bounded."""
    head = f"{type(exc).__name__}: {exc}"
    tail = "".join(traceback.format_tb(exc.__traceback__)[-frames:])
    text = f"{head}\n{tail}".rstrip() if tail else head
    return clean_text(text)


def clean_text(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Text the database and a terminal can take: no NUL, no lone surrogate, bounded."""
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        text = text[: limit - 20] + f"... [{len(text) - limit + 20} more]"
    return text


__all__ = ["LEASED", "Job", "Outcome", "State", "clean_text", "format_error"]
