"""Handlers of the workflow the console's browser test runs on real `worker run` processes
(tests/test_console_ui.py): a chain, a group with a join, a step that fails until the operator
has fixed what it needs (a file exists), and a step that works until it is cancelled."""

from __future__ import annotations

import os
import time
from typing import Any

import worker


def _work(seconds: float, ctx: worker.Context | None = None) -> None:
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if ctx is not None:
            ctx.check()  # a cancel request stops it
        time.sleep(min(left, 0.05))


@worker.task("orders.fetch")
def fetch(payload: dict[str, Any]) -> int:
    _work(0.3)
    return int(payload["orders"])


@worker.task("orders.split")
def split(payload: dict[str, Any], ctx: worker.Context) -> int:
    _work(0.2)
    return int(ctx.inputs[0]) // 3


@worker.task("orders.price")
def price(payload: dict[str, Any], ctx: worker.Context) -> int:
    _work(0.4)
    return int(ctx.inputs[0]) * int(payload["unit"])


@worker.task("orders.check_stock", max_attempts=1)
def check_stock(payload: dict[str, Any], ctx: worker.Context) -> int:
    _work(0.2)
    if not os.path.exists(payload["ready_if"]):
        raise RuntimeError("the stock service did not answer (503 Service Unavailable)")
    return int(ctx.inputs[0])


@worker.task("orders.merge")
def merge(payload: dict[str, Any], ctx: worker.Context) -> list[Any]:
    _work(0.2)
    return list(ctx.inputs)


@worker.task("orders.invoice")
def invoice(payload: dict[str, Any], ctx: worker.Context) -> int:
    _work(0.3)
    return sum(int(i) for i in ctx.inputs[0])


@worker.task("orders.export")
def export(payload: dict[str, Any], ctx: worker.Context) -> None:
    _work(float(payload["seconds"]), ctx)
