"""Storing a handler's return value with its row (schema/0012), and telling waiters.

A task stores its result when its handler says so (``@task(..., store_result=True)``) or the
worker stores every handler's (``WorkerConfig.store_results``, ``worker run --store-results``);
``store_result=False`` on a handler opts it out of the latter. The runner thread encodes the value
(``encode_result``): JSON that a ``jsonb`` column takes, at most ``max_result_bytes`` of it.
Anything else fails the task at once with ``ResultTooLarge`` or ``ResultNotSerializable``, as does
an object whose keys would collide once written as JSON text.

The store marks the rows with a result done (``worker.store.complete_with_result``), in the same
acknowledging transaction as the others and with the same fencing, and only when a batch holds
such rows; so tasks that store nothing keep exactly the acknowledgement they had. The same
transaction then notifies the channel ``<schema>.done`` with the ids, which is what wakes
``worker.wait``. Tasks that store no result send no notification: a waiter finds them by
polling.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from ..db.sql import validate_schema_name
from ..errors import ConfigError, ResultNotSerializable, ResultTooLarge
from .registry import Registry, TaskDef

if TYPE_CHECKING:
    from ..engine.settings import WorkerConfig

DEFAULT_MAX_RESULT_BYTES = 64 * 1024
# A NUL escaped by json.dumps (\u0000 after an even number of backslashes): jsonb refuses it.
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def done_channel(schema: str) -> str:
    """The channel that finished tasks which store a result are announced on."""
    return f"{validate_schema_name(schema)}.done"


def stores(definition: TaskDef, store_all: bool) -> bool:
    """Whether a handler's return value is stored: its own say, else the worker's."""
    return store_all if definition.store_result is None else definition.store_result


def check_config(config: WorkerConfig, registry: Registry) -> None:
    """Results live in the row, so a worker that deletes rows at completion (keep_done 0)
    cannot store them: a waiter would find nothing. Refuse to start rather than drop them."""
    if config.max_result_bytes < 1:
        raise ConfigError("max_result_bytes must be at least 1")
    if config.keep_done_seconds > 0:
        return
    storing = [
        name
        for name in registry.names()
        if (d := registry.get(name)) is not None and stores(d, config.store_results)
    ]
    if storing:
        more = ", ..." if len(storing) > 5 else ""
        raise ConfigError(
            "tasks that store results need their done rows kept, and --keep-done 0 deletes them "
            f"at completion (tasks storing results: {', '.join(storing[:5])}{more}); keep them "
            "as long as results are read, e.g. --keep-done 3600"
        )


def encode_result(value: Any, limit: int = DEFAULT_MAX_RESULT_BYTES) -> str:
    """The JSON text of a handler's return value, as the ``result`` column will hold it.

    Raises ``ResultNotSerializable`` for what is not JSON (a set, an object, NaN), what jsonb
    cannot hold (a NUL character, a lone surrogate) or would silently change (an object with two
    keys that JSON writes as the same text, as ``1`` and ``"1"``: one would be lost), and
    ``ResultTooLarge`` past ``limit`` bytes (UTF-8). Checked here, on the runner thread, so that
    the acknowledging statement never meets a value the database would refuse (that would roll
    back the whole batch's acknowledgement).
    """
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ResultNotSerializable(
            f"the handler's return value is not JSON-serialisable ({type(exc).__name__}: "
            f"{str(exc)[:200]}); return a dict, list, str, number, bool or None"
        ) from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ResultNotSerializable(
            "the handler's return value holds a lone surrogate, which is not valid UTF-8"
        ) from None
    if size > limit:
        raise ResultTooLarge(
            f"the handler's return value is {size:,} bytes of JSON, over the limit of "
            f"{limit:,} (raise max_result_bytes / --max-result-size, or store the data "
            "elsewhere and return a reference to it)"
        )
    collision = _colliding_keys(value)
    if collision is not None:
        raise ResultNotSerializable(collision)
    if "\\u0000" in text and _NUL.search(text):
        raise ResultNotSerializable(
            "the handler's return value holds a NUL character (\\u0000), which jsonb refuses"
        )
    return text


def _json_key(key: Any) -> str:
    """A dict key as json.dumps writes it (it has accepted every key by now)."""
    if isinstance(key, str):
        return key
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    if isinstance(key, int):
        return int.__repr__(key)
    return float.__repr__(key)


def _colliding_keys(value: Any) -> str | None:
    """The message for the first object of ``value`` holding two keys that JSON writes as the
    same text (``1`` and ``"1"``, ``True`` and ``"true"``, ``None`` and ``"null"``): jsonb keeps
    only the last of them, so the stored result would silently lose a value. Other non-string
    keys are written as text, as json.dumps writes them (``{1: "a"}`` is stored as
    ``{"1": "a"}``). None when there is no such object. Walks without recursion: json.dumps took
    the value, so it is a tree of dicts, lists, tuples and scalars."""
    stack: list[tuple[Any, str]] = [(value, "result")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                seen: dict[str, Any] = {}
                for key in node:
                    text = _json_key(key)
                    if text in seen:
                        return (
                            f"the handler's return value has two keys that JSON writes as the "
                            f"same text, {seen[text]!r} and {key!r} (in {path[:200]}): an object "
                            "stored as JSON would keep only one of them; make the keys strings "
                            "(or distinct once written as text)"
                        )
                    seen[text] = key
            stack.extend((v, f"{path}[{k!r}]") for k, v in node.items())
        elif isinstance(node, list | tuple):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "check_config",
    "done_channel",
    "encode_result",
    "stores",
]
