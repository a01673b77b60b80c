"""``worker locks``: lock rows and advisory locks with their holders, and a forced release."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ..coord.advisory import list_advisory_locks
from ..coord.exclusive import force_release, list_locks
from ..coord.locks import DEFAULT_NAMESPACE
from .common import CliError, connect, print_json, require, table
from .text import safe


def _expiry(row: Mapping[str, Any]) -> str:
    seconds = row["expires_in_seconds"]
    if seconds is None:
        return "never"
    if seconds >= 0:
        return f"in {seconds:.1f}s"
    return f"expired {-seconds:.1f}s ago"


def _query_summary(query: str | None, width: int = 80) -> str:
    """The statement on one line, without its leading comments (ours start with one)."""
    lines = [ln for ln in (query or "").splitlines() if not ln.lstrip().startswith("--")]
    return " ".join(" ".join(lines).split())[:width]


def cmd_locks(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        require(conn, args.schema)
        if args.release:
            released = force_release(conn, args.schema, args.release)
            if released is None:
                raise CliError(f"no lock named {args.release!r}")
            holder, kind = released
            print(f"released {kind} lock {safe(repr(args.release))} (was held by {safe(holder)})")
            return 0
        rows = list_locks(conn, args.schema)
        advisory = list_advisory_locks(conn, namespace=args.namespace)
    if args.json:
        print_json({"locks": rows, "advisory": advisory})
        return 0
    print(f"lock rows ({sum(1 for r in rows if r['held'])} held)")
    if rows:
        table(
            ["name", "kind", "holder", "state", "acquired", "expires"],
            [
                [
                    r["name"],
                    r["kind"],
                    r["holder"],
                    "held" if r["held"] else "free",
                    r["acquired_at"].strftime("%Y-%m-%d %H:%M:%S"),
                    _expiry(r),
                ]
                for r in rows
            ],
        )
    print()
    print(f"advisory locks ({len(advisory)})")
    if advisory:
        table(
            ["pid", "keys", "namespace", "granted", "state", "xact age", "query"],
            [
                [
                    str(a["pid"]),
                    f"{a['key1']},{a['key2']}" if a["two_keys"] else str(a["key"]),
                    a["namespace"] or "-",
                    "yes" if a["granted"] else "waiting",
                    a["state"] or "-",
                    f"{a['xact_seconds']:.1f}s" if a["xact_seconds"] is not None else "-",
                    _query_summary(a["query"]),
                ]
                for a in advisory
            ],
        )
    return 0


def locks_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace",
        default=DEFAULT_NAMESPACE,
        help="advisory-lock namespace to mark as ours (default: worker)",
    )
    p.add_argument(
        "--release",
        metavar="NAME",
        default=None,
        help="delete lock row NAME whoever holds it (e.g. a mutex whose holder died)",
    )
    p.set_defaults(func=cmd_locks)
