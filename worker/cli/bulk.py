"""`worker retry`, `worker cancel` and `worker delete`: one task by id (the old forms, in
commands.py), or every task a filter matches (worker/ops/bulk.py), counted first.

Without --yes a filter only counts: how many tasks would change, which would be skipped, and a
few examples; nothing is written. With --yes the action runs in batches of --batch-size rows, one
transaction each, and is recorded in the schema's `actions` table with who ran it (--actor, by
default the OS user and host).

`worker retry --failed [--queue Q]` keeps its old meaning: every failure (of Q) now, no --yes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import replace

from ..ops import bulk as _bulk
from ..ops.audit import default_actor
from ..ops.bulk import BulkError, Filter, Outcome
from ..ops.status import STATES
from .args import TASK_ID, int_in, text_up_to
from .common import CliError, connect, print_json, require
from .interrupt import Interrupt
from .one_task import cmd_cancel as cancel_one
from .one_task import cmd_retry as retry_one
from .text import LINE_LIMIT, safe

MAX_SECONDS = 100 * 365 * 86400.0
_UNITS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)([wdhms]))+|(\d+(?:\.\d+)?)")
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
VERBS = {
    "retry": ("requeue", "requeued"),
    "cancel": ("cancel", "cancelled"),
    "delete": ("delete", "deleted"),
}


def duration(text: str) -> float:
    """A flag type: seconds, as 90, 90s, 30m, 1.5h, 7d, 2w or 1h30m."""
    spec = text.strip().lower()
    if not _DURATION.fullmatch(spec):
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 90s, 30m, 1h, 7d or 1h30m, got {text!r}"
        )
    parts = _PART.findall(spec)
    value = sum(float(n) * _UNITS[u] for n, u in parts) if parts else float(spec)
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"a duration of at most 100 years, got {text!r}")
    return value


def state_list(text: str) -> tuple[str, ...]:
    """A flag type: one state or several, comma-separated."""
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [s for s in names if s not in STATES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown state {', '.join(repr(s) for s in unknown) or repr(text)}: "
            f"one or more of {', '.join(STATES)}"
        )
    return names


def id_list(text: str) -> tuple[int, ...]:
    """A flag type: task ids, comma-separated."""
    ids = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            ids.append(TASK_ID(part.strip()))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"--ids: {exc}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--ids: expected ids such as 12,15,99")
    if len(ids) > _bulk.MAX_IDS:
        raise argparse.ArgumentTypeError(f"--ids: at most {_bulk.MAX_IDS:,} ids")
    return tuple(ids)


def _add_filters(p: argparse.ArgumentParser, action: str, *, queue: bool = True) -> None:
    allowed, default = _bulk.ACTIONS[action]
    if queue:
        p.add_argument("--queue", default=None, help="only tasks of this queue")
    p.add_argument("--task", default=None, help="only tasks of this name")
    p.add_argument(
        "--state",
        type=state_list,
        default=(),
        help=f"comma-separated: {', '.join(allowed)} (default: {', '.join(default)})",
    )
    p.add_argument(
        "--error",
        default=None,
        metavar="PATTERN",
        help="last error ILIKE PATTERN, over the whole error: %% any text, _ one character, "
        "\\ escapes them ('Timeout%%': errors starting with Timeout; '%%refused%%': holding it)",
    )
    p.add_argument(
        "--older-than",
        type=duration,
        default=None,
        metavar="DURATION",
        help="finished that long ago (done, failed, cancelled) or created that long ago "
        "(scheduled, queued): 90s, 30m, 1h, 7d, 1h30m",
    )
    p.add_argument("--ids", type=id_list, default=(), help="only these task ids: 12,15,99")
    p.add_argument("--yes", action="store_true", help="act; without it, only count and show")
    p.add_argument(
        "--actor",
        "--by",
        dest="actor",
        type=text_up_to(200),
        default=os.environ.get("WORKER_ACTOR") or None,  # an empty variable is no actor
        help="who to record as running the action (default: $WORKER_ACTOR, else user@host; "
        "for one task cancelled by id: the database role)",
    )
    p.add_argument(
        "--batch-size",
        type=int_in(1, _bulk.MAX_BATCH),
        default=_bulk.BATCH,
        help=f"rows per transaction (default {_bulk.BATCH:,})",
    )
    p.add_argument(
        "--examples", type=int_in(0, 100), default=_bulk.EXAMPLES, help="tasks a count shows"
    )


def retry_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=TASK_ID, nargs="?")
    p.add_argument(
        "--failed", action="store_true", help="requeue every failed task now (of --queue)"
    )
    _add_filters(p, "retry")
    p.set_defaults(func=cmd_retry)


def cancel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=TASK_ID, nargs="?")
    _add_filters(p, "cancel")
    p.set_defaults(func=cmd_cancel)


def delete_arguments(p: argparse.ArgumentParser) -> None:
    _add_filters(p, "delete")
    p.set_defaults(func=cmd_delete)


def _filter(args: argparse.Namespace, *, queue: bool = True) -> Filter | None:
    """The bulk filter the flags give; None when they give none."""
    flt = Filter(
        queue=args.queue if queue else None,
        task=args.task,
        states=tuple(args.state),
        error=args.error,
        older_than=args.older_than,
        ids=tuple(args.ids),
    )
    return None if flt == Filter() else flt


def cmd_retry(args: argparse.Namespace) -> int:
    if args.id is not None:
        if args.failed or _filter(args) is not None:
            raise CliError("give a task id or a filter, not both", 2)
        return retry_one(args)
    flt = _filter(args, queue=not args.failed)
    if args.failed:
        if flt is None:
            return retry_one(args)  # --failed [--queue Q]: every failure, at once
        if args.state:
            raise CliError("give --failed or --state, not both", 2)
        flt = replace(flt, queue=args.queue, states=("failed",))
    if flt is None:
        raise CliError(
            "give a task id, --failed, or a filter (--queue, --task, --state, --error, "
            "--older-than, --ids)",
            2,
        )
    return _run(args, "retry", flt)


def cmd_cancel(args: argparse.Namespace) -> int:
    flt = _filter(args)
    if args.id is not None:
        if flt is not None:
            raise CliError("give a task id or a filter, not both", 2)
        return cancel_one(args)
    if flt is None:
        raise CliError(
            "give a task id or a filter (--queue, --task, --state, --error, --older-than, --ids)",
            2,
        )
    return _run(args, "cancel", flt)


def cmd_delete(args: argparse.Namespace) -> int:
    flt = _filter(args)
    if flt is None:
        raise CliError(
            "give a filter (--queue, --task, --state, --error, --older-than, --ids); "
            "--state done,failed,cancelled for every finished task",
            2,
        )
    return _run(args, "delete", flt)


def _run(args: argparse.Namespace, action: str, flt: Filter) -> int:
    try:
        flt.check()
        states = _bulk.states_for(action, flt)
    except BulkError as exc:
        raise CliError(str(exc), 2) from None
    actor = args.actor or default_actor()
    code = 0
    if not args.yes:
        with connect(args) as conn:
            require(conn, args.schema)
            out = _bulk.preview(conn, args.schema, action, flt, examples=args.examples)
    else:
        tell = sys.stderr.isatty() and not args.json
        with Interrupt(tell=tell) as stop, connect(args) as conn:
            stop.conn = conn
            require(conn, args.schema)
            progress = _progress if tell else None
            out = _bulk.apply(
                conn,
                args.schema,
                action,
                flt,
                actor=actor,
                source="cli",
                batch=args.batch_size,
                progress=progress,
                stop=stop,
            )
            stop.conn = None
        code = stop.code if out.interrupted is not None else 0
        if out.interrupted is not None and not args.json:
            print(interrupted_line(out, flt, states))
            return code
    if args.json:
        print_json(out.as_dict())
        return code
    _report(out, flt, states)
    return 0


def interrupted_line(out: Outcome, flt: Filter, states: list[str]) -> str:
    """The one line of an action stopped between two batches: what it did, and what to do."""
    done = VERBS[out.action][1]
    what = safe(describe(flt, states), LINE_LIMIT)
    if out.batches == 0:
        did = f"before any batch committed: nothing {done}"
    else:
        did = (
            f"after {out.batches:,} batch(es): {done} {out.changed:,} of the {out.matched:,} "
            "task(s) matched so far"
        )
        if out.skipped_dedupe:
            did += f", skipped {out.skipped_dedupe:,} whose dedupe key a live task holds"
    return (
        f"interrupted by {out.interrupted} {did}, matching {what}; recorded as action "
        f"#{out.action_id} by {safe(out.actor)}; the rest are as they were: run it again to go on"
    )


def _progress(out: Outcome) -> None:
    if out.batches % 20 == 0:
        verb = VERBS[out.action][1]
        print(f"worker: {out.matched:,} matched, {out.changed:,} {verb} so far...", file=sys.stderr)


def _ids(ids: list[int], total: int) -> str:
    shown = ", ".join(f"#{i}" for i in ids)
    return f" ({shown}{', ...' if total > len(ids) else ''})" if ids else ""


def _report(out: Outcome, flt: Filter, states: list[str]) -> None:
    verb, done = VERBS[out.action]
    what = safe(describe(flt, states), LINE_LIMIT)
    if out.dry_run:
        print(f"would {verb} {out.matched - out.skipped_dedupe:,} task(s) matching {what}")
    else:
        print(f"{done} {out.changed:,} task(s) in {out.batches:,} batch(es), matching {what}")
    if out.skipped_dedupe:
        stay = "would stay" if out.dry_run else "stay"
        print(
            f"  skipped {out.skipped_dedupe:,} whose dedupe key a scheduled, queued or running "
            f"task holds{_ids(out.skipped_dedupe_ids, out.skipped_dedupe)}: they {stay} as they are"
        )
    if out.changed_meanwhile:
        print(
            f"  left {out.changed_meanwhile:,} alone that changed state before the action "
            "reached them (a worker took them, say)"
        )
    if out.running:
        more = "+" if out.running_capped else ""
        print(
            f"  left {out.running:,}{more} running task(s) alone that match"
            f"{_ids(out.running_ids, out.running)}: running tasks are never {done}"
        )
    if out.dry_run:
        if out.examples:
            print("examples:")
            for e in out.examples:
                when = e["finished_at"] or e["created_at"]
                error = (e["last_error"] or "").splitlines()[0] if e["last_error"] else ""
                print(
                    f"  #{e['id']} {e['state']} [{safe(e['queue'])}] {safe(e['task'])} "
                    f"attempts {e['attempts']}, {when:%Y-%m-%d %H:%M:%S}"
                    + (f": {safe(error, 160)}" if error else "")
                )
        if flt.error is not None and not re.search(r"(?<!\\)[%_]", flt.error):
            print(
                "  (--error is a pattern over the whole error: use "
                f"{safe(repr('%' + flt.error + '%'))} for text anywhere in it)"
            )
        print(f"nothing changed: add --yes to {verb} them")
    else:
        state = "" if out.complete else " (interrupted)"
        print(f"recorded as action #{out.action_id} by {safe(out.actor)}{state}")


def describe(flt: Filter, states: Iterable[str]) -> str:
    """The filter in words, for a terminal (the caller escapes it)."""
    parts = [f"state {'/'.join(states)}"]
    if flt.queue is not None:
        parts.append(f"queue {flt.queue!r}")
    if flt.task is not None:
        parts.append(f"task {flt.task!r}")
    if flt.error is not None:
        parts.append(f"error ILIKE {flt.error!r}")
    if flt.older_than is not None:
        parts.append(f"older than {span(flt.older_than)}")
    if flt.ids:
        shown = ", ".join(str(i) for i in sorted(set(flt.ids))[:10])
        parts.append(f"id in ({shown}{', ...' if len(set(flt.ids)) > 10 else ''})")
    return ", ".join(parts)


def span(seconds: float) -> str:
    """Seconds in the units a person types: 90 -> 1m30s, 86400 -> 1d, 0.5 -> 0.5s."""
    if seconds != int(seconds) or seconds < 60:
        return f"{seconds:g}s"
    left, out = int(seconds), []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            out.append(f"{left // size}{unit}")
            left %= size
    return "".join(out)
