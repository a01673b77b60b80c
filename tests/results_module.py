"""Handlers for tests/test_results.py, run by real `worker run` processes."""

from __future__ import annotations

import time
from typing import Any

import worker


@worker.task("r_echo", store_result=True)
def r_echo(payload: dict[str, Any]) -> dict[str, Any]:
    time.sleep(float(payload.get("sleep", 0)))
    return {
        "payload": payload,
        "text": "naïve café, 東京, 🙂, \u202e",
        "nested": {"list": [1, 2.5, None, True, {"deep": ["x"]}]},
        "returned_at": time.time(),  # when the handler returned, by this machine's clock
    }


@worker.task("r_async", store_result=True)
async def r_async(payload: dict[str, Any]) -> list[Any]:
    return ["async", payload.get("n")]


@worker.task("r_plain")
def r_plain(payload: dict[str, Any]) -> dict[str, Any]:
    return {"not": "stored"}  # no store_result: thrown away, as before


@worker.task("r_sized", store_result=True, max_attempts=3)
def r_sized(payload: dict[str, Any]) -> str:
    return "x" * int(payload["size"])


@worker.task("r_unstorable", store_result=True, max_attempts=3)
def r_unstorable(payload: dict[str, Any]) -> Any:
    kind = payload["kind"]
    if kind == "set":
        return {1, 2}
    if kind == "nan":
        return float("nan")
    if kind == "nul":
        return "a\x00b"
    return "\ud800"  # a lone surrogate


@worker.task("r_keys", store_result=True, max_attempts=3)
def r_keys(payload: dict[str, Any]) -> Any:
    kind = payload["kind"]
    if kind == "int and str":
        return {"counts": {1: "one as a number", "1": "one as text"}}
    if kind == "none and null":
        return [{None: 0, "null": 1}]
    if kind == "true and str":
        return {True: "yes", "true": "also yes"}
    return {1: "a", 2.5: "b", None: "c", False: "d", "x": {7: "e"}}  # written as text, no clash


@worker.task("r_fail", store_result=True, max_attempts=1)
def r_fail(payload: dict[str, Any]) -> None:
    raise ValueError("boom: ünïcode")


@worker.task("r_tx", transactional=True, store_result=True)
def r_tx(payload: dict[str, Any], ctx: worker.Context) -> Any:
    assert ctx.conn is not None
    return {"tx": ctx.task_id, "size": "y" * int(payload.get("size", 0))}
