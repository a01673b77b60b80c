"""Typed payloads: a task registered with ``payload=SomeModel`` (a dataclass or a pydantic model)
is checked when enqueued and handed to its handler as an instance of the model.

The row always holds plain JSON, so SQL producers and other languages keep working. The producer
validates before inserting (the error comes at the call site), and the worker validates again
when it decodes the row: a row written by plain SQL that does not fit the model fails at once and
for good (it will never fit; retrying it would only waste attempts).

pydantic is never imported here. A pydantic (v2) model is recognised by its methods
(``model_validate``, ``model_dump``), so ``import worker`` costs nothing and needs nothing when
pydantic is not installed, and a model is only ever touched through its own class.

Dataclasses get a shallow check: required and unknown fields, and plain types (str, int, float,
bool, list, dict, nested dataclasses, optional and union types of those). Anything finer is what
pydantic is for.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from ..errors import PayloadError

_PLAIN = (str, int, float, bool, list, dict)


def is_pydantic_model(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "model_validate") and hasattr(tp, "model_dump")


def check_model(tp: Any) -> None:
    """At registration: ``payload=`` must be a dataclass or a pydantic model class."""
    if is_pydantic_model(tp) or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return
    raise TypeError(f"payload= must be a dataclass or a pydantic model class, not {tp!r}")


def to_json(task: str, payload: Any, model: type | None) -> Any:
    """What the row stores for ``payload``: a model instance serialised, a dict validated first
    when the task has a model. Raises PayloadError naming the task and the field."""
    if model is not None and not isinstance(payload, model):
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise PayloadError(
                f"task {task!r} takes a {model.__name__} payload (or a dict of its fields), "
                f"not {type(payload).__name__}"
            )
        payload = from_json(task, model, payload)
    if is_pydantic_model(type(payload)):
        return payload.model_dump(mode="json")
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        return dataclasses.asdict(payload)
    return payload


def from_json(task: str, model: type, data: Any) -> Any:
    """An instance of ``model`` built from a row's decoded payload; PayloadError if it does not
    fit (one line: the task, the model, the first problems by field)."""
    where = f"task {task!r}: payload does not fit {model.__name__}"
    if is_pydantic_model(model):
        try:
            return model.model_validate(data)  # type: ignore[attr-defined]
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise PayloadError(f"{where}: {_pydantic_problems(exc)}") from None
    try:
        return _dataclass(model, data, "")
    except _Invalid as exc:
        raise PayloadError(f"{where}: field {exc.field!r}: {exc.problem}") from None


def _pydantic_problems(exc: ValueError, limit: int = 3) -> str:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc).splitlines()[0]
    found = errors()
    parts = []
    for err in found[:limit]:
        field = ".".join(str(p) for p in err.get("loc", ())) or "payload"
        parts.append(f"field {field!r}: {err.get('msg', 'invalid')}")
    if len(found) > limit:
        parts.append(f"and {len(found) - limit} more")
    return "; ".join(parts)


class _Invalid(Exception):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field = field or "payload"
        self.problem = problem


def _dataclass(model: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise _Invalid(path, f"expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(model) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise _Invalid(f"{path}{unknown[0]}", "unknown field")
    try:
        hints = typing.get_type_hints(model)
    except Exception:  # an unresolvable annotation: check the fields' presence only
        hints = {}
    values = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Invalid(f"{path}{name}", "missing")
            continue
        values[name] = _value(hints.get(name, Any), data[name], f"{path}{name}")
    return model(**values)


def _value(hint: Any, value: Any, path: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, f"{path}.")
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(arms) < len(typing.get_args(hint)):
            return None
        if len(arms) == 1:  # Optional[X]: X's own message, with its own field path
            return _value(arms[0], value, path)
        problems = []
        for arm in arms:
            try:
                return _value(arm, value, path)
            except _Invalid as exc:
                problems.append(exc.problem)
        raise _Invalid(path, " or ".join(problems))
    if hint is type(None):
        if value is None:
            return None
        raise _Invalid(path, f"expected null, got {type(value).__name__}")
    plain = origin if origin in _PLAIN else hint
    if plain in _PLAIN:
        ok = isinstance(value, plain) and not (plain in (int, float) and isinstance(value, bool))
        if plain is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)  # JSON has one kind of number
        if not ok:
            raise _Invalid(path, f"expected {plain.__name__}, got {type(value).__name__}")
    return value


__all__ = ["check_model", "from_json", "is_pydantic_model", "to_json"]
