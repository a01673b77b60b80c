"""What becomes of a claimed row before a runner sees it: the handler it names, and its payload
decoded (and built into the task's model, for typed payloads).

A row no handler of this worker takes is not this worker's to fail (an older worker in a rolling
deploy, or a typo): it goes back uncounted, later each time, until a worker that has the handler
takes it. A payload that cannot be decoded, or does not fit the task's model, fails its task at
once and for good: it never will. Each payload is decoded on its own, after the claim committed,
so one hostile row (nested thousands deep, a number of thousands of digits) fails alone; and on
the main thread rather than the runners, so a batch costs the runners no extra turns at the GIL.
"""

from __future__ import annotations

from typing import Any

from ..errors import PayloadError
from ..store import Claimed
from ..tasks.payload import from_json
from ..tasks.registry import Registry, TaskDef
from .job import clean_text, decode_payload, display


def _unknown_handler(payload: Any) -> None:  # pragma: no cover - never called
    raise RuntimeError("unknown task")


# The definition a job of an unknown task carries while it goes back.
UNKNOWN = TaskDef(name="<unknown>", fn=_unknown_handler)


def unknown_task(task: str, registry: Registry, worker_id: str) -> str:
    """The error a row of a task without a handler here goes back with."""
    known = ", ".join(registry.names()) or "none"
    why = registry.why_missing(task) or f"known: {known[:1000]}"
    return (
        f"UnknownTask: no handler named '{display(task)}' in worker {worker_id[:8]} ({why}); "
        "handed back without counting the attempt, until a worker that has the handler takes it"
    )


def payload_of(c: Claimed, definition: TaskDef) -> tuple[Any, str | None]:
    """(the payload the handler gets, None), or (None, the error that fails the task for good)."""
    try:
        payload = decode_payload(c.payload)
        if definition.payload is not None:
            payload = from_json(c.task, definition.payload, payload)
    except PayloadError as exc:
        return None, clean_text(f"PayloadError: {exc}; not retried")
    except Exception as exc:
        return None, clean_text(
            f"PayloadError: the payload cannot be decoded ({type(exc).__name__}: {exc}); "
            "it stays in the row as written"
        )
    return payload, None


__all__ = ["UNKNOWN", "payload_of", "unknown_task"]
