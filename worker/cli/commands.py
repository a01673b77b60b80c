"""The short commands: migrate, enqueue, status, retry and cancel of one task, dsn, embedded, bench
and demo (`worker status --id` is in task.py; bulk retry, cancel and delete in bulk.py)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime

import psycopg

from ..coord import pause as _pause
from ..db.dsn import dsn_source_from_env, redact
from ..db.migrate import migrate
from ..dev import bench, demo
from ..dev.embedded import EmbeddedError, EmbeddedPostgres, default_data_dir
from ..dev.embedded.attached import attached_workers
from ..errors import SchemaMissing
from ..ops import actions as _actions
from ..ops import bulk as _bulk
from ..ops import status as _admin
from ..ops.status import STATES, status
from ..tasks import limits as _limits
from ..tasks import routes
from ..tasks.enqueue import enqueue
from ..tasks.registry import registry
from . import exits
from . import limits as limits_cli
from .common import (
    CliError,
    age,
    connect,
    console_token,
    import_tasks,
    print_json,
    require,
    resolve_dsn,
    start_over,
    table,
)
from .task import cmd_task
from .text import LINE_LIMIT, safe
from .workflow import cmd_workflow

# The largest payload `worker enqueue` reads (jsonb itself stops at 255 MB).
MAX_PAYLOAD = 64 * 1024 * 1024


def _payload_text(spec: str) -> str:
    """--payload JSON, @FILE or - (stdin): large payloads need not fit on a command line."""
    if spec != "-" and not spec.startswith("@"):
        return spec
    where = "stdin" if spec == "-" else repr(spec[1:])
    try:
        if spec == "-":
            data = sys.stdin.buffer.read(MAX_PAYLOAD + 1)
        else:
            with open(spec[1:], "rb") as fh:
                data = fh.read(MAX_PAYLOAD + 1)
    except OSError as exc:
        raise CliError(f"--payload: cannot read {where}: {exc.strerror}", 2) from None
    if len(data) > MAX_PAYLOAD:
        raise CliError(f"--payload: {where} holds more than {MAX_PAYLOAD} bytes", 2)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"--payload: {where} is not UTF-8 (byte {exc.start})", 2) from None


def cmd_migrate(args: argparse.Namespace) -> int:
    declared: dict[str, str] = {}
    if args.module:
        import_tasks(args.module)
        declared = routes.of(registry)
        if not declared:
            raise CliError(f"module {args.module!r} registers no task", 2)
    with connect(args) as conn:
        applied = migrate(conn, args.schema)
        routes.record(conn, args.schema, declared)
    if args.json:
        print_json({"applied": applied, "routes": declared})
        return 0
    if applied:
        print(f"applied {len(applied)} migration(s) to schema {args.schema}: {', '.join(applied)}")
    else:
        print(f"schema {args.schema} is up to date")
    if declared:
        where = ", ".join(f"{safe(t)} -> {safe(q)}" for t, q in sorted(declared.items())[:10])
        more = f" and {len(declared) - 10} more" if len(declared) > 10 else ""
        print(f"recorded the queues of {len(declared)} task(s): {where}{more}")
    return 0


def cmd_enqueue(args: argparse.Namespace) -> int:
    if not args.name:
        raise CliError("the task name must not be empty", 2)
    if args.queue == "":
        raise CliError("--queue must not be empty", 2)
    try:
        payload = json.loads(_payload_text(args.payload))
    except json.JSONDecodeError as exc:
        raise CliError(f"--payload is not valid JSON: {exc.msg} at position {exc.pos}", 2) from None
    except RecursionError:
        raise CliError("--payload is nested too deeply", 2) from None
    run_at = None
    if args.run_at:
        try:
            run_at = datetime.fromisoformat(args.run_at)
        except ValueError:
            raise CliError(f"--run-at is not an ISO timestamp: {args.run_at!r}", 2) from None
        if args.delay is not None:
            raise CliError("give --run-at or --delay, not both", 2)
        if run_at.tzinfo is None:
            raise CliError("--run-at needs a time zone, e.g. 2026-01-01T09:00:00+00:00", 2)
    with connect(args) as conn:
        # No version check first: it reads the migration table, which the producer role of
        # deploy/sql/roles.sql may not read. Enqueueing is one call of the SQL function; a
        # schema without it raises SchemaMissing, made precise below (which version it is at).
        try:
            task_id = enqueue(
                conn,
                args.name,
                payload,
                queue=args.queue,
                run_at=run_at,
                delay=args.delay,
                priority=args.priority,
                max_attempts=args.max_attempts,
                dedupe_key=args.dedupe_key,
                schema=args.schema,
            )
        except SchemaMissing:
            require(conn, args.schema)  # says which: no tables, or an old version
            raise
        if not args.quiet:
            _warn_unrouted(conn, args.schema, args.name)
    if args.json:
        print_json({"id": task_id})
    else:
        print(task_id)
    return 0


def _warn_unrouted(conn: psycopg.Connection, schema: str, task: str) -> None:
    """One line on stderr when no worker has ever declared ``task``: its row waits in the default
    queue until one does (a typo waits for ever). A role that may not read the routes skips it."""
    try:
        with conn.transaction():
            known = routes.routed(conn, schema, task)
    except psycopg.errors.InsufficientPrivilege:
        return
    if not known:
        print(
            f"worker: warning: no worker has declared task {_quote(task)}: it waits in the "
            "default queue until one does (a typo? `worker migrate --module MODULE` records "
            "your tasks' queues ahead of their workers; --quiet silences this)",
            file=sys.stderr,
        )


def _count(q: _admin.QueueStatus, state: str) -> str:
    """Exact; or, past the cap, ≈ the planner's estimate (when it is above the cap) or ≥ the
    lower bound."""
    n = q.counts.get(state, 0)
    if state not in q.capped:
        return f"{n:,}"
    guess = q.estimates.get(state)
    return f"≈{guess:,}" if guess is not None and guess > n else f"≥{n:,}"


def _quote(name: str) -> str:
    return repr(name[:80] + ("..." if len(name) > 80 else ""))


def cmd_status(args: argparse.Namespace) -> int:
    if getattr(args, "id", None) is not None:
        return cmd_task(args)
    if getattr(args, "workflow", None) is not None:
        return cmd_workflow(args)
    with connect(args) as conn:
        require(conn, args.schema)
        st = status(conn, args.schema, failed_limit=args.failed)
        paused = {p.queue: p for p in _pause.paused(conn, args.schema)}
        limited = _limits.list_limits(conn, args.schema)
    if args.json:
        print_json(
            {
                **st.as_dict(),
                "paused": [
                    {"queue": p.queue, "paused_at": p.paused_at, "paused_by": p.paused_by}
                    for p in paused.values()
                ],
                "limits": [limits_cli.as_dict(q) for q in limited],
            }
        )
        return 0
    # Workflow steps waiting for their dependencies: a column only where there are some.
    shown = [s for s in STATES if s != "waiting" or any(_count(q, s) != "0" for q in st.queues)]
    head = ["queue", *(s.replace("_", " ") for s in shown), "oldest due", "live worker"]
    rows = [
        [
            q.queue + (" (paused)" if q.queue in paused else ""),
            *(_count(q, s) for s in shown),
            age(q.oldest_seconds),
            "yes" if q.served else "none",
        ]
        for q in st.queues
    ]
    table(head, rows or [["(no tasks)"] + [""] * (len(head) - 1)])
    if any(q.capped for q in st.queues):
        print(
            f"(counts stop at {st.cap:,}: ≈ is the planner's estimate beyond, ≥ the count where "
            "the estimate is lower)"
        )
    if st.truncated_after is not None:
        print(
            f"(too many queue names: the queues after {safe(_quote(st.truncated_after))} "
            "are not listed)"
        )
    if paused:
        print()
        print("paused queues (workers claim nothing from them; `worker resume QUEUE`)")
        for p in paused.values():
            when = p.paused_at.strftime("%Y-%m-%d %H:%M:%S")
            print(f"  {safe(_quote(p.queue))} since {when} by {safe(p.paused_by)}")
    if limited:
        print()
        print("limited queues (fleet-wide; `worker limits set QUEUE ...` changes them)")
        limits_cli.print_limits(limited)
    advice = st.routing.advice(_quote)
    if advice:
        print()
        print("work no live worker will do")
        for line in advice:
            print(f"  {safe(line, LINE_LIMIT)}")
    print()
    alive = st.routing.workers_alive
    print(f"workers ({len(st.workers)} registered, {alive} alive)")
    if st.workers:
        table(
            ["id", "host", "pid", "started", "heartbeat", "in flight", "queues"],
            [
                [
                    str(w["id"])[:8],
                    w["host"],
                    str(w["pid"]),
                    w["started_at"].strftime("%Y-%m-%d %H:%M:%S"),
                    age(w["heartbeat_age_seconds"]) + " ago",
                    str(w["in_flight"]),
                    ",".join(w["queues"]),
                ]
                for w in st.workers
            ],
        )
    if st.failed:
        print()
        print(f"recent failed tasks (newest first, up to {args.failed})")
        for f in st.failed:
            first = (f["last_error"] or "").splitlines()[0] if f["last_error"] else ""
            print(
                f"  #{f['id']} {safe(f['task'])} [{safe(f['queue'])}] after {f['attempts']} "
                f"attempt(s): {safe(first, 160)}"
            )
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    if args.id is None and not args.failed:
        raise CliError("give a task id or --failed", 2)
    with connect(args) as conn:
        require(conn, args.schema)
        if args.failed:
            done = _bulk.retry_failed(conn, args.schema, args.queue)
            if args.json:
                print_json(done.as_dict())
                return 0
            print(f"requeued {done.requeued} failed task(s)")
            if done.skipped:
                ids = ", ".join(f"#{i}" for i in done.skipped_ids)
                more = ", ..." if done.skipped > len(done.skipped_ids) else ""
                print(
                    f"skipped {done.skipped} whose dedupe key a scheduled, queued or running task "
                    f"holds ({ids}{more}): they stay failed; retry them once that task is done"
                )
            return 0
        one = _actions.retry(conn, args.schema, [args.id])
        if one.skipped:
            raise CliError(
                f"task {args.id} was not requeued: its dedupe key is held by a scheduled, queued "
                "or running task"
            )
        if not one.changed:
            raise CliError(f"task {args.id} is not failed or cancelled (or does not exist)")
        print(f"requeued task {args.id}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """One line saying what happened; exit 1 when nothing could be cancelled."""
    with connect(args) as conn:
        require(conn, args.schema)
        done = _actions.cancel_one(conn, args.schema, args.id, by=args.actor)
    if args.json:
        print_json(done.as_dict())
        return 0 if done.outcome in ("cancelled", "requested") else 1
    if done.outcome == "cancelled":
        print(f"cancelled task {args.id} (it had not started)")
    elif done.outcome == "requested":
        print(f"cancel requested for task {args.id}: it is running, its worker will stop it")
    elif done.outcome == "finished":
        raise CliError(f"task {args.id} was not cancelled: it is {done.state} already")
    else:
        raise CliError(f"task {args.id} was not cancelled: there is no such task")
    return 0


def cmd_dsn(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args.dsn, quiet=True)
    print(dsn if args.show_password else redact(dsn))
    return 0


def cmd_embedded(args: argparse.Namespace) -> int:
    """start, stop or status. A failure is one line and exit 2, as for the embedded server that
    a command without a DSN cannot start: there is no PostgreSQL to run (the ``embedded`` extra
    is not installed), or the server would not start or stop (the cause from its log)."""
    try:
        return _embedded(args)
    except EmbeddedError as exc:
        raise CliError(str(exc), exits.USAGE) from None


def _embedded(args: argparse.Namespace) -> int:
    data_dir = default_data_dir()
    server = EmbeddedPostgres(data_dir)
    if args.action == "stop":
        if not server.is_running():
            # Stopping a stopped server is done already: say so, not "stopped".
            print(f"the embedded PostgreSQL in {data_dir} is not running")
            return 0
        _warn_attached_workers(server.dsn)
        server.stop()
        print(f"stopped the embedded PostgreSQL in {data_dir}")
    elif args.action == "start":
        print(server.start())
    else:
        running = server.is_running()
        print(f"{'running' if running else 'stopped'}: {data_dir}")
        return exits.OK if running else exits.NO  # as `systemctl status`: non-zero when stopped
    return exits.OK


def _warn_attached_workers(dsn: str) -> None:
    """One line on stderr when worker processes are connected: stopping the server leaves them
    retrying their connection (their tasks come back once it runs again and leases lapse)."""
    try:
        rows = attached_workers(dsn)
    except psycopg.Error:
        return  # stopping is still the right thing to do; pg_ctl says what it finds
    if rows:
        total = sum(n for _, n in rows)
        where = ", ".join(f"{n} on database {safe(db)}" for db, n in rows)
        print(
            f"worker: warning: {total} worker process(es) are attached ({where}); they will "
            "retry their connections until the server runs again: stop them first "
            "(Ctrl-C or SIGTERM) to end them cleanly",
            file=sys.stderr,
        )


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
