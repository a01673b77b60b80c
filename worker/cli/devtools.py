"""``worker bench`` and ``worker demo``: the developer tools, from the command line."""

from __future__ import annotations

import argparse

from ..db.dsn import dsn_source_from_env
from ..dev import bench, demo
from .args import MAX_PROCESSES, int_in, rate_in
from .common import resolve_dsn
from .handover import console_token, start_over


def bench_arguments(p: argparse.ArgumentParser) -> None:
    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)


def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tasks",
        type=int_in(1, 1_000_000),
        default=None,
        help="enqueue this many tasks at once and exit when they have settled",
    )
    p.add_argument("--processes", type=int_in(1, MAX_PROCESSES), default=2)
    p.add_argument(
        "--rate",
        type=rate_in(0.1, 10_000),
        default=20.0,
        help="tasks enqueued per second until Ctrl-C (default 20)",
    )
    p.add_argument(
        "--port",
        type=int_in(1, 65535),
        default=None,
        help="the console's port (default 9187, or a free one when it is taken)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_bench(args: argparse.Namespace) -> int:
    bench.check(args)
    return bench.main(args, resolve_dsn(args.dsn))


def cmd_demo(args: argparse.Namespace) -> int:
    # The console's token, like `worker run`'s: out of this process's environment (it starts
    # over without it), kept in memory, and handed to the pool that serves the console by pipe.
    live = args.tasks is None
    if getattr(args, "from_command_line", False):
        start_over(args.argv, {}, serving=live)
    token = console_token(None, serving=live)
    embedded = not args.dsn and dsn_source_from_env() is None
    return demo.main(args, resolve_dsn(args.dsn), embedded=embedded, console_token=token)
