"""Handlers whose signature hides their parameters (``*args``, as any decorator without
functools.wraps leaves them) are accepted and run by real workers, with the context when they
can take it; handlers that could never be called are refused at registration."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import psycopg
import pytest
from conftest import states, wait_until

import worker


def unwrapped(fn: Any) -> Any:
    """A decorator that forgot functools.wraps."""

    def inner(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return inner


def test_star_args_handlers_run_with_payload_and_context(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    seen: dict[str, Any] = {}
    reg = worker.Registry()

    @reg.task("wrapped")
    @unwrapped
    def wrapped(payload: dict, ctx: worker.Context) -> None:
        seen["wrapped"] = (payload, ctx.task)

    @reg.task("varargs")
    def varargs(*args: Any) -> None:
        seen["varargs"] = (args[0], type(args[1]).__name__)

    @reg.task("payload_then_varargs")
    def payload_then_varargs(payload: Any, *rest: Any) -> None:
        seen["payload_then_varargs"] = (payload, len(rest))

    @reg.task("optional_ctx")
    def optional_ctx(payload: Any, ctx: worker.Context | None = None) -> None:
        seen["optional_ctx"] = ctx is not None

    @reg.task("partial")
    def _base(prefix: str, payload: Any) -> None:
        seen["partial"] = prefix + str(payload)

    reg.task("partial2")(functools.partial(_base.fn, "p:"))

    @reg.task("wrapped_async")
    @unwrapped
    async def wrapped_async(payload: Any, ctx: worker.Context) -> None:
        await asyncio.sleep(0.01)
        seen["wrapped_async"] = (payload, ctx.attempt)

    for name in ("wrapped", "varargs", "payload_then_varargs", "optional_ctx", "partial2"):
        worker.enqueue(conn, name, {"n": name}, schema=schema)
    worker.enqueue(conn, "wrapped_async", 7, schema=schema)
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 6})
    assert seen == {
        "wrapped": ({"n": "wrapped"}, "wrapped"),
        "varargs": ({"n": "varargs"}, "Context"),
        "payload_then_varargs": ({"n": "payload_then_varargs"}, 1),
        "optional_ctx": True,
        "partial": "p:{'n': 'partial2'}",
        "wrapped_async": (7, 1),
    }


def test_definitions_stay_callable_as_plain_functions() -> None:
    reg = worker.Registry()

    @reg.task("t")
    @unwrapped
    def t(payload: int, ctx: Any = None) -> int:
        return payload + 1

    assert t(1) == 2
    reg.task("t")(t.fn.handler)  # registering the same function again is no conflict


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda: None, "must accept the payload"),
        (lambda a, b, c: None, "needs 3 arguments"),
        (lambda p, *, flag: None, "required keyword-only"),
    ],
)
def test_handlers_that_cannot_be_called_are_refused(fn: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        worker.Registry().task("x")(fn)


def test_a_payload_only_handler_behind_a_decorator_without_wraps_gets_the_payload_only(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """The common trap: `@logged def handle(payload)` where `logged` returns `inner(*args,
    **kwargs)`. The wrapper could take a context, but the handler it wraps cannot: the worker
    looks through the wrapper and passes the payload alone, so the task runs instead of failing
    with a TypeError on every attempt."""
    seen: list[Any] = []
    reg = worker.Registry()

    @reg.task("logged")
    @unwrapped
    def handle(payload: dict) -> None:
        seen.append(payload)

    worker.enqueue(conn, "logged", {"n": 1}, schema=schema)
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 1}, timeout=20)
    assert seen == [{"n": 1}]
