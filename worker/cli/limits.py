"""``worker limits``: fleet-wide concurrency and rate limits per queue and per key (see
worker/tasks/limits.py). ``worker limits`` lists them with what each queue holds now; ``set`` and
``clear`` change them at run time: every worker applies a change within about a second, and code
declarations no longer change a queue an operator set (until it is cleared)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from ..tasks import limits as _limits
from .args import common_flags
from .common import CliError, connect, print_json, require, table
from .pause import _operator, queue_name
from .text import safe


def _value(text: str) -> int | str:
    """A flag's text as a whole number when it is one; the checks (tasks/limits.py) say what
    is wrong with the rest, as they do for the Python API."""
    try:
        return int(text)
    except ValueError:
        return text


def _rate_dict(rate: tuple[int, float] | None) -> dict[str, Any] | None:
    return None if rate is None else {"starts": rate[0], "seconds": rate[1]}


def as_dict(q: _limits.QueueLimits) -> dict[str, Any]:
    lim = q.limits
    return {
        "queue": q.queue,
        "concurrency": lim.concurrency,
        "key_concurrency": lim.key_concurrency,
        "rate": _rate_dict(lim.rate),
        "key_rate": _rate_dict(lim.key_rate),
        "source": q.source,
        "updated_by": q.updated_by,
        "updated_at": q.updated_at,
        "running": q.running,
        "waiting": q.waiting,
        "recent_starts": q.recent_starts,
        "running_keys": q.running_keys,
        "burst": q.limits.burst,
        "key_burst": q.limits.key_burst,
    }


def print_limits(found: list[_limits.QueueLimits]) -> None:
    """The table `worker limits` and `worker status` print."""
    table(
        ["queue", "concurrency", "per key", "rate", "per key rate", "running", "waiting",
         "set by"],
        [
            [
                safe(q.queue),
                "-" if q.limits.concurrency is None else str(q.limits.concurrency),
                "-" if q.limits.key_concurrency is None else str(q.limits.key_concurrency),
                _limits.describe_rate(q.limits.rate),
                _limits.describe_rate(q.limits.key_rate),
                str(q.running),
                str(q.waiting),
                "code" if q.source == "code" else safe(q.updated_by),
            ]
            for q in found
        ],
    )  # fmt: skip


def cmd_limits(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        require(conn, args.schema)
        found = _limits.list_limits(conn, args.schema)
    if args.json:
        print_json({"limits": [as_dict(q) for q in found]})
    elif not found:
        print("no queue has limits")
    else:
        print_limits(found)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    """Every value is checked here, before the database sees it, by the checks of the Python API
    (Limits.of): a value out of range or malformed is one line naming its flag, exit 2."""
    for flag, burst, rate in (("--burst", args.burst, args.rate),
                              ("--key-burst", args.key_burst, args.key_rate)):  # fmt: skip
        if burst is not None and rate is None:
            raise CliError(f"{flag} goes with {flag.replace('burst', 'rate')}", 2)
    if all(v is None for v in (args.concurrency, args.key_concurrency, args.rate, args.key_rate)):
        raise CliError(
            "give at least one of --concurrency, --key-concurrency, --rate, --key-rate"
            " (`worker limits clear QUEUE` removes a queue's limits)",
            2,
        )
    try:
        limits = _limits.Limits.of(
            concurrency=None if args.concurrency is None else _value(args.concurrency),
            key_concurrency=None if args.key_concurrency is None else _value(args.key_concurrency),
            rate=args.rate,
            key_rate=args.key_rate,
            burst=None if args.burst is None else _value(args.burst),
            key_burst=None if args.key_burst is None else _value(args.key_burst),
        )
    except _limits.LimitError as exc:
        raise CliError(f"--{exc.field.replace('_', '-')} {exc.problem}", 2) from None
    by = args.by if args.by is not None else _operator()
    with connect(args) as conn:
        require(conn, args.schema)
        _limits.set_limits(conn, args.schema, args.queue, limits, by=by)
    if args.json:
        print_json({"queue": args.queue, "changed": True})
    else:
        print(f"limits of queue {safe(args.queue)} set: workers apply them within a second")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        require(conn, args.schema)
        changed = _limits.clear_limits(conn, args.schema, args.queue)
    if args.json:
        print_json({"queue": args.queue, "changed": changed})
    elif changed:
        print(f"limits of queue {safe(args.queue)} removed")
    else:
        raise CliError(f"queue {safe(args.queue)} has no limits")
    return 0


def limits_arguments(p: argparse.ArgumentParser) -> None:
    common = common_flags()
    p.set_defaults(func=cmd_limits)
    actions = p.add_subparsers(dest="limits_action")
    s = actions.add_parser(
        "set", parents=[common], help="set a queue's limits (every one: those not given are off)"
    )
    s.add_argument("queue", type=queue_name)
    # "--rate -1/s" is a value to check, not an unknown flag (argparse takes only plain negative
    # numbers for values).
    s._negative_number_matcher = re.compile(r"^-\d")
    # Values as text: cmd_set checks them, so that each mistake is one line naming its flag.
    s.add_argument(
        "--concurrency",
        metavar="N",
        help=f"most running in the queue (0 to {_limits.MAX_CONCURRENCY:,}; 0: nothing starts)",
    )
    s.add_argument(
        "--key-concurrency",
        metavar="N",
        help=f"most running per key of the queue (0 to {_limits.MAX_CONCURRENCY:,})",
    )
    s.add_argument(
        "--rate",
        metavar="N/PERIOD",
        help="most starts per period in the queue: 50/s, 1000/h, 10/5min (1 or more, at most "
        f"{_limits.MAX_PER_SECOND:,} a second, a period of up to a year)",
    )
    s.add_argument("--key-rate", metavar="N/PERIOD", help="most starts per period per key: 10/min")
    s.add_argument(
        "--burst",
        metavar="N",
        help=f"starts --rate lets through at once after a quiet spell (1 to "
        f"{_limits.MAX_BURST:,}; default 1: evenly spaced)",
    )
    s.add_argument("--key-burst", metavar="N", help="the same for --key-rate, per key")
    s.add_argument("--by", default=None, help="who sets them, for the record (default: user@host)")
    s.set_defaults(func=cmd_set)
    c = actions.add_parser("clear", parents=[common], help="remove a queue's limits")
    c.add_argument("queue", type=queue_name)
    c.set_defaults(func=cmd_clear)
