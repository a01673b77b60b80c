"""The ``worker`` command. Every failure a user can cause ends in one line on stderr and a non-zero
exit, never a traceback: exit 2 for configuration (flags, DSN, schema, module), 1 otherwise."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from ._config import SecretFilter, redact, resolve_dsn, scrub
from ._errors import ConfigError
from ._sql import validate_schema_name

log = logging.getLogger("worker")


class CliError(Exception):
    """A one-line message for the user, with its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# -- helpers -------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {value}")
    return value


def _schema(text: str) -> str:
    try:
        return validate_schema_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _connect(args: argparse.Namespace) -> psycopg.Connection:
    return _connect_dsn(resolve_dsn(args.dsn, quiet=getattr(args, "json", False)))


def _require(conn: psycopg.Connection, schema: str) -> None:
    from ._migrate import require_schema

    require_schema(conn, schema)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def import_tasks(module: str) -> None:
    """Import the user's module (which registers handlers), from a dotted name or a .py path."""
    sys.path.insert(0, os.getcwd())
    try:
        if module.endswith(".py") or os.sep in module:
            path = Path(module)
            if not path.is_file():
                raise CliError(f"cannot import {module!r}: no such file", 2)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec and spec.loader
            mod = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = mod
            spec.loader.exec_module(mod)
        else:
            importlib.import_module(module)
    except CliError:
        raise
    except ModuleNotFoundError as exc:
        raise CliError(
            f"cannot import module {module!r}: {exc} (is it on PYTHONPATH, or in this folder?)", 2
        ) from None
    except Exception as exc:
        raise CliError(f"importing {module!r} failed: {type(exc).__name__}: {exc}", 2) from None


# -- commands ------------------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    from ._migrate import migrate

    with _connect(args) as conn:
        applied = migrate(conn, args.schema)
    if args.json:
        _print_json({"applied": applied})
    elif applied:
        print(f"applied {len(applied)} migration(s) to schema {args.schema}: {', '.join(applied)}")
    else:
        print(f"schema {args.schema} is up to date")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ._registry import registry
    from ._supervisor import Supervisor, child_command
    from ._worker import Worker, WorkerConfig

    import_tasks(args.module)
    if len(registry) == 0:
        raise CliError(
            f"module {args.module!r} registered no tasks (decorate handlers with @worker.task)", 2
        )
    dsn = resolve_dsn(args.dsn)
    processes = args.processes or os.cpu_count() or 1
    if processes > 1 and not args.child:
        # Check the database and schema once, here, so a bad DSN is one clear line, not P of them.
        with _connect_dsn(dsn) as conn:
            _require(conn, args.schema)
        sup = Supervisor(
            child_command(args.argv),
            processes,
            grace_seconds=args.grace,
            stuck_seconds=args.stuck_after or max(60.0, args.lease * 2),
            start_seconds=args.start_timeout,
            burst=args.burst,
        )
        metrics = _start_metrics(args, dsn)
        if metrics is not None:
            sup.on_child_exit = metrics.child_exited
        try:
            return sup.run()
        finally:
            if metrics:
                metrics.stop()
    config = WorkerConfig(
        dsn=dsn,
        schema=args.schema,
        queues=[q for q in args.queues.split(",") if q] if args.queues else None,
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        lease_seconds=args.lease,
        poll_interval=args.poll_interval,
        grace_seconds=args.grace,
        listen=not args.no_listen and not (args.pgbouncer and not args.listen_dsn),
        prepare=not args.pgbouncer,
        listen_dsn=args.listen_dsn,
        keep_done_seconds=args.keep_done,
        keep_failed_seconds=args.keep_failed,
        burst=args.burst,
    )
    if args.child:
        _wait_for_database(dsn, args.schema)
    else:
        with _connect_dsn(dsn) as conn:
            _require(conn, args.schema)
    hooks = _worker_hooks(args)
    metrics = None if args.child else _start_metrics(args, dsn)
    worker = Worker(config, hooks=hooks)
    if args.child:
        _stop_with_parent(worker)

    def on_signal(signum: int, _frame: object) -> None:
        log.info(
            "received %s: finishing in-flight tasks (grace %.0fs)",
            signal.Signals(signum).name,
            args.grace,
        )
        worker.stop(now=worker._stop.is_set())  # a second signal stops at once

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        code = worker.run()
    finally:
        if metrics:
            metrics.stop()
    if args.report:
        _write_report(args.report, worker)
    return code


def _write_report(path: str, worker: Any) -> None:
    """Benchmark marks of this process, appended as one JSON line (several processes share it)."""
    import resource

    line = json.dumps(
        {
            "pid": os.getpid(),
            "first_claim": worker.first_claim,
            "last_ack": worker.last_ack,
            "done": worker.done_count,
            "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        }
    )
    with open(path, "a") as fh:
        fh.write(line + "\n")


def _connect_dsn(dsn: str) -> psycopg.Connection:
    """Connect, or fail with one line that names the database without its password."""
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        first = scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise CliError(
            f"cannot connect to the database at {redact(dsn)}: {first} "
            "(check --dsn, WORKER_DSN or DATABASE_URL)",
            2,
        ) from None


def _stop_with_parent(worker: Any) -> None:
    """A supervised child stops gracefully when its supervisor is gone (killed with SIGKILL, say).
    Children run in their own sessions, so nothing else would stop them: they would work on
    unsupervised, next to the pool of a restarted supervisor."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while not worker._stop.wait(1.0):
            if os.getppid() != parent:
                log.warning("supervisor (pid %d) is gone; stopping this worker", parent)
                worker.stop()
                return

    threading.Thread(target=watch, name="worker-parent", daemon=True).start()


def _wait_for_database(dsn: str, schema: str) -> None:
    """A supervised child started while the database is down (replacing one that died) waits for
    it, as running workers do, instead of exiting: quick exits would look like a crash loop and
    make the supervisor give up on the whole pool. The supervisor already checked the DSN and the
    schema, so this is an outage, not a configuration error. The liveness touch tells the
    supervisor the child is waiting, not stuck."""
    import time

    from ._supervisor import LIVENESS_ENV

    liveness = os.environ.get(LIVENESS_ENV)
    parent = os.getppid()
    delay = 0.5
    while os.getppid() == parent:  # no waiting on for a supervisor that is gone
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
                _require(conn, schema)
            return
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("database unavailable (%s); waiting %.1fs", scrub(first), delay)
        if liveness:
            os.utime(liveness)
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
    raise CliError("the supervisor is gone; not starting", 1)


def _worker_hooks(args: argparse.Namespace) -> Any:
    """Metrics hooks when metrics are on (see issue: metrics); plain hooks otherwise."""
    from ._metrics import worker_hooks

    # Children inherit --metrics-port in their argv: they count, and the supervisor serves.
    return worker_hooks(enabled=bool(args.metrics_port))


def _start_metrics(args: argparse.Namespace, dsn: str) -> Any:
    if not args.metrics_port:
        return None
    from ._metrics import serve

    # Under a supervisor (the same test as in cmd_run) the server must exist before the children
    # do: it creates the PROMETHEUS_MULTIPROC_DIR they inherit and aggregate their counts through.
    supervised = not args.child and (args.processes or os.cpu_count() or 1) > 1
    return serve(
        args.metrics_host,
        args.metrics_port,
        dsn=dsn,
        schema=args.schema,
        multiprocess=supervised,
    )


def cmd_enqueue(args: argparse.Namespace) -> int:
    from ._enqueue import enqueue

    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise CliError(f"--payload is not valid JSON: {exc.msg} at position {exc.pos}", 2) from None
    run_at = None
    if args.run_at:
        try:
            run_at = datetime.fromisoformat(args.run_at)
        except ValueError:
            raise CliError(f"--run-at is not an ISO timestamp: {args.run_at!r}", 2) from None
        if run_at.tzinfo is None:
            raise CliError("--run-at needs a time zone, e.g. 2026-01-01T09:00:00+00:00", 2)
    with _connect(args) as conn:
        _require(conn, args.schema)
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
    if args.json:
        _print_json({"id": task_id})
    else:
        print(task_id)
    return 0


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def cmd_status(args: argparse.Namespace) -> int:
    from ._admin import STATES, status

    with _connect(args) as conn:
        _require(conn, args.schema)
        st = status(conn, args.schema, failed_limit=args.failed)
    if args.json:
        _print_json(st.as_dict())
        return 0
    head = ["queue", *STATES, "delayed", "oldest"]
    rows = [
        [
            q.queue,
            *(str(q.counts.get(s, 0)) for s in STATES),
            str(q.delayed),
            _age(q.oldest_seconds),
        ]
        for q in st.queues
    ]
    _table(head, rows or [["(no tasks)"] + [""] * (len(head) - 1)])
    print()
    print(f"workers ({len(st.workers)} alive)")
    if st.workers:
        _table(
            ["id", "host", "pid", "started", "heartbeat", "in flight", "queues"],
            [
                [
                    w["id"][:8],
                    w["host"],
                    str(w["pid"]),
                    w["started_at"].strftime("%Y-%m-%d %H:%M:%S"),
                    _age(w["heartbeat_age_seconds"]) + " ago",
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
                f"  #{f['id']} {f['task']} [{f['queue']}] after {f['attempts']} attempt(s): "
                f"{first[:160]}"
            )
    return 0


def _table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    for row in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())


def cmd_retry(args: argparse.Namespace) -> int:
    from . import _admin

    if args.id is None and not args.failed:
        raise CliError("give a task id or --failed", 2)
    with _connect(args) as conn:
        _require(conn, args.schema)
        if args.failed:
            n = _admin.retry_failed(conn, args.schema, args.queue)
            print(f"requeued {n} failed task(s)")
            return 0
        if not _admin.retry(conn, args.schema, args.id):
            raise CliError(f"task {args.id} is not failed or cancelled (or does not exist)")
        print(f"requeued task {args.id}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from . import _admin

    with _connect(args) as conn:
        _require(conn, args.schema)
        if not _admin.cancel(conn, args.schema, args.id):
            task = _admin.get_task(conn, args.schema, args.id)
            state = task["state"] if task else "missing"
            raise CliError(
                f"task {args.id} cannot be cancelled: it is {state} (only queued tasks can)"
            )
    print(f"cancelled task {args.id}")
    return 0


def cmd_dsn(args: argparse.Namespace) -> int:
    print(resolve_dsn(args.dsn, quiet=True))
    return 0


def cmd_embedded(args: argparse.Namespace) -> int:
    from ._embedded import EmbeddedPostgres, default_data_dir

    server = EmbeddedPostgres(default_data_dir())
    if args.action == "stop":
        server.stop()
        print(f"stopped the embedded PostgreSQL in {default_data_dir()}")
    elif args.action == "start":
        print(server.start())
    else:
        print(f"{'running' if server.is_running() else 'stopped'}: {default_data_dir()}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ._bench import main as bench_main

    return bench_main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import main as demo_main

    return demo_main(args)


def _plugin_commands() -> list[Callable[[Any], None]]:
    """Commands contributed by optional modules (cron, locks) register their parsers here."""
    adders = []
    for name in ("_cron", "_locks"):
        mod = importlib.import_module(f"worker.{name}")
        add = getattr(mod, "add_cli", None)
        if add:
            adders.append(add)
    return adders


# -- parser --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dsn",
        help="PostgreSQL URL or conninfo (default: $WORKER_DSN, "
        "$DATABASE_URL, else the embedded server)",
    )
    common.add_argument(
        "--schema",
        type=_schema,
        default=os.environ.get("WORKER_SCHEMA", "worker"),
        help="schema holding the queue tables (default: worker)",
    )
    common.add_argument(
        "--log-level",
        default=os.environ.get("WORKER_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")

    parser = argparse.ArgumentParser(prog="worker", description="A PostgreSQL work queue.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", parents=[common], help="create or upgrade the queue schema")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("run", parents=[common], help="run workers for the tasks of MODULE")
    p.add_argument("module", help="module (dotted name or .py path) whose import registers tasks")
    p.add_argument(
        "--queues",
        help="comma-separated queues (default: the registered tasks' queues and 'default')",
    )
    p.add_argument(
        "--concurrency",
        type=_positive_int,
        default=10,
        help="task slots (threads) per process (default 10)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=100,
        help="most tasks claimed per statement (default 100)",
    )
    p.add_argument(
        "--processes",
        type=_positive_int,
        default=None,
        help="worker processes (default: number of CPUs)",
    )
    p.add_argument(
        "--grace",
        type=_seconds,
        default=30.0,
        help="seconds to finish in-flight tasks on SIGTERM (default 30)",
    )
    p.add_argument(
        "--lease",
        type=_seconds,
        default=30.0,
        help="seconds a claim stays valid without a heartbeat (default 30)",
    )
    p.add_argument(
        "--poll-interval",
        type=_seconds,
        default=1.0,
        help="seconds between polls when no NOTIFY arrives (default 1)",
    )
    p.add_argument("--no-listen", action="store_true", help="poll only, no LISTEN/NOTIFY")
    p.add_argument(
        "--pgbouncer",
        action="store_true",
        help="--dsn goes through PgBouncer in transaction mode: no prepared "
        "statements, and LISTEN only through --listen-dsn",
    )
    p.add_argument(
        "--listen-dsn",
        default=os.environ.get("WORKER_LISTEN_DSN"),
        help="direct (not pooled) DSN for LISTEN when --dsn goes through PgBouncer",
    )
    p.add_argument(
        "--keep-done",
        type=_seconds,
        default=3600.0,
        help="seconds to keep done rows (0: delete on completion; default 3600)",
    )
    p.add_argument(
        "--keep-failed",
        type=_seconds,
        default=7 * 86400.0,
        help="seconds to keep failed rows (default 7 days)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics, /healthz, /readyz and the status page on this port",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument(
        "--burst", action="store_true", help="exit once no task is due and none is running"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # Seconds without a liveness touch before the supervisor kills a child as stuck (default
    # max(60, 2 x lease)); hidden, for tests and unusual deployments.
    p.add_argument(
        "--start-timeout",
        type=_seconds,
        default=300.0,
        help="seconds a worker process may take to import MODULE and reach its loop before the "
        "supervisor replaces it (default 300)",
    )
    p.add_argument("--stuck-after", type=_seconds, default=None, help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("enqueue", parents=[common], help="enqueue one task")
    p.add_argument("name", help="task name")
    p.add_argument("--payload", default="{}", help="JSON payload (default {})")
    p.add_argument("--queue", default=None)
    p.add_argument("--priority", type=int, default=0, help="higher runs first")
    p.add_argument("--delay", type=_seconds, default=None, help="run after this many seconds")
    p.add_argument("--run-at", default=None, help="ISO timestamp with time zone")
    p.add_argument("--max-attempts", type=_positive_int, default=None)
    p.add_argument("--dedupe-key", default=None)
    p.set_defaults(func=cmd_enqueue)

    p = sub.add_parser("status", parents=[common], help="queues, workers and recent failures")
    p.add_argument("--failed", type=int, default=10, help="how many recent failures to list")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("retry", parents=[common], help="requeue a failed task, or all of them")
    p.add_argument("id", type=int, nargs="?")
    p.add_argument("--failed", action="store_true", help="requeue every failed task")
    p.add_argument("--queue", default=None, help="with --failed: only this queue")
    p.set_defaults(func=cmd_retry)

    p = sub.add_parser("cancel", parents=[common], help="cancel a queued task")
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser(
        "dsn",
        parents=[common],
        help="print the DSN (starting the embedded server when no DSN is configured)",
    )
    p.set_defaults(func=cmd_dsn)

    p = sub.add_parser(
        "embedded", parents=[common], help="start, stop or inspect the embedded PostgreSQL"
    )
    p.add_argument("action", choices=["start", "stop", "status"])
    p.set_defaults(func=cmd_embedded)

    p = sub.add_parser(
        "bench", parents=[common], help="measure enqueue and drain against the bare-SQL ceiling"
    )
    from ._bench import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", parents=[common], help="run a worker with a demo producer")
    p.add_argument("--tasks", type=_positive_int, default=2000, help="how many demo tasks")
    p.add_argument("--processes", type=_positive_int, default=2)
    p.set_defaults(func=cmd_demo)

    for add in _plugin_commands():
        add(sub, common)
    return parser


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    )
    handler.addFilter(SecretFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("psycopg.pool").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    _setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"worker: error: {scrub(str(exc))}", file=sys.stderr)
        return exc.code
    except ConfigError as exc:
        print(f"worker: error: {scrub(str(exc))}", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"worker: database error: {scrub(first)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
