"""The job browser's filter and its page cursor, as they travel in URLs and forms.

A filter comes from a query string a person (or anyone sending them a link) wrote: every field is
checked, a field that cannot be used is dropped with a one-line note saying why, and nothing in
it reaches SQL other than as a bound value. The cursor is the sort key of a page's last row
(browse.sql), encoded so that a link can carry it; one that does not decode, or belongs to
another order, is ignored and the first page shown.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

STATES = ("waiting", "scheduled", "queued", "in_progress", "done", "failed", "cancelled")
NAME_CHARS = 255  # queue and task names, as the table allows (schema/0004)
TEXT_CHARS = 200  # text searched in payloads and errors
MAX_ID = 2**63 - 1
START = datetime.min.replace(tzinfo=UTC)  # what the console reads for -infinity
END = datetime.max.replace(tzinfo=UTC)  # and for infinity
# Which statement of browse.sql walks which state.
MODES = {
    None: "any",
    "waiting": "any",  # no index holds waiting steps: the walk of every row, by id
    "in_progress": "running",
    "queued": "queued",
    "scheduled": "scheduled",
    "done": "finished",
    "cancelled": "finished",
    "failed": "failed",
}


@dataclass(frozen=True)
class Filter:
    queue: str | None = None
    task: str | None = None
    state: str | None = None
    id: int | None = None
    text: str | None = None

    @property
    def mode(self) -> str:
        return MODES[self.state]

    @property
    def narrows_walk(self) -> bool:
        """Whether rows of the walk may fail the filter (then a page may need more than its own
        number of rows, and the walk is bounded by the scan limit instead)."""
        queue_in_walk = self.mode in ("queued", "scheduled", "failed")
        return bool(
            self.task
            or self.text
            or (self.queue and not queue_in_walk)
            or self.mode == "finished"  # done and cancelled share their index
            or self.state == "waiting"  # read among every row
        )

    @property
    def empty(self) -> bool:
        return not (self.queue or self.task or self.state or self.id or self.text)

    def fields(self) -> dict[str, str]:
        """The filter as query-string fields (those that are set)."""
        out = {
            "queue": self.queue,
            "task": self.task,
            "state": self.state,
            "id": str(self.id) if self.id else None,
            "text": self.text,
        }
        return {k: v for k, v in out.items() if v}

    def query(self, **extra: str) -> str:
        return urlencode({**self.fields(), **extra})

    def pattern(self) -> str | None:
        """The text as an ILIKE pattern matching it anywhere, its wildcards taken literally."""
        if not self.text:
            return None
        escaped = self.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return f"%{escaped}%"


def _first(query: Mapping[str, list[str]], key: str) -> str:
    values = query.get(key) or [""]
    return values[0].strip()


def parse_filter(query: Mapping[str, list[str]]) -> tuple[Filter, list[str]]:
    """The filter of a query string (``parse_qs`` form) and a note for each field dropped."""
    notes: list[str] = []
    names: dict[str, str | None] = {}
    for key in ("queue", "task"):
        value = _first(query, key)
        if len(value) > NAME_CHARS:
            notes.append(f"{key} ignored: a {key} name has at most {NAME_CHARS} characters")
            value = ""
        names[key] = value or None
    state = _first(query, "state") or None
    if state is not None and state not in STATES:
        notes.append(f"state ignored: not one of {', '.join(STATES)}")
        state = None
    task_id: int | None = None
    raw_id = _first(query, "id").lstrip("#")
    if raw_id:
        if raw_id.isdigit() and 1 <= int(raw_id) <= MAX_ID:
            task_id = int(raw_id)
        else:
            notes.append("id ignored: a task id is a positive whole number")
    text = _first(query, "text")
    if len(text) > TEXT_CHARS:
        notes.append(f"text ignored: search for at most {TEXT_CHARS} characters")
        text = ""
    return Filter(names["queue"], names["task"], state, task_id, text or None), notes


# -- the cursor ------------------------------------------------------------------------------------


def _stamp(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value == END:
        return "infinity"
    if value == START:
        return "-infinity"
    return value.isoformat()


def encode_cursor(mode: str, row: Mapping[str, Any]) -> str:
    """The position after ``row`` in the order of ``mode``, for the next page's link."""
    if mode == "queued":
        key: list[Any] = [row["queue"], -int(row["priority"]), _stamp(row["run_at"]), row["id"]]
    elif mode == "scheduled":
        key = [_stamp(row["run_at"]), row["id"]]
    elif mode in ("finished", "failed"):
        key = [_stamp(row["finished_at"]), row["id"]]
    else:
        key = [row["id"]]
    raw = json.dumps([mode, *key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _timestamp(value: Any) -> str:
    """A timestamp from a cursor, as text PostgreSQL reads (checked here, bound as a value)."""
    if value in ("infinity", "-infinity"):
        return str(value)
    if not isinstance(value, str):
        raise ValueError("not a timestamp")
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValueError("no time zone")
    return parsed.isoformat()


def _bigint(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_ID:
        raise ValueError("not an id")
    return value


def walk_params(mode: str, cursor: str | None) -> dict[str, Any]:
    """The ``after_*`` values of the browse statement of ``mode``: from the cursor when it is one
    of this mode, else those that start before every row."""
    params: dict[str, Any] = {
        "after_id": MAX_ID,
        "after_queue": "",
        "after_priority": -(2**31),
        "after_at": "-infinity",
        "in_nulls": True,
        "after_finished_id": MAX_ID,
    }
    if mode in ("queued", "scheduled"):  # ascending orders start at the lowest id
        params["after_id"] = 0
    elif mode in ("finished", "failed"):
        params["after_at"] = "infinity"
    if not cursor:
        return params
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        decoded = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        if not isinstance(decoded, list) or not decoded or decoded[0] != mode:
            return params
        key = decoded[1:]
        if mode == "queued":
            queue, priority, run_at, task_id = key
            if not isinstance(queue, str) or len(queue) > NAME_CHARS:
                raise ValueError("not a queue")
            if not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
                raise ValueError("not a priority")
            params.update(
                after_queue=queue,
                after_priority=priority,
                after_at=_timestamp(run_at),
                after_id=_bigint(task_id),
            )
        elif mode == "scheduled":
            run_at, task_id = key
            params.update(after_at=_timestamp(run_at), after_id=_bigint(task_id))
        elif mode in ("finished", "failed"):
            finished_at, task_id = key
            if finished_at is None:  # still among the rows without a finished_at
                params.update(after_id=_bigint(task_id))
            else:
                params.update(
                    in_nulls=False,
                    after_at=_timestamp(finished_at),
                    after_finished_id=_bigint(task_id),
                )
        else:
            (task_id,) = key
            params.update(after_id=_bigint(task_id))
    except (ValueError, TypeError, binascii.Error, UnicodeError, json.JSONDecodeError):
        return walk_params(mode, None)
    return params


__all__ = ["END", "MAX_ID", "START", "STATES", "Filter", "encode_cursor", "parse_filter"]
