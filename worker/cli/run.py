"""``worker run``: one worker process, or a supervisor and its children."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import resource
import signal
import threading
import time
from typing import Any

import psycopg

from ..db.connect import CLI, connect
from ..db.outage import OUTAGE
from ..engine.loop import Worker, WorkerConfig
from ..engine.supervisor import (
    DSN_OPTIONS,
    LIVENESS_ENV,
    Supervisor,
    child_command,
    die_with_parent,
    without_options,
)
from ..monitor.hosts import split_host
from ..monitor.metrics.counters import worker_hooks
from ..monitor.server import serve
from ..tasks.registry import DEFAULT_QUEUE, registry
from ..tasks.results import check_config as check_results_config
from .common import (
    CliError,
    checked_dsn,
    connect_dsn,
    import_tasks,
    require,
    resolve_dsn,
)
from .handover import console_token, start_over

log = logging.getLogger("worker")
LISTEN_ENV = "WORKER_LISTEN_DSN"
# Where a DSN given on the command line travels instead (to a restarted process, to children):
# a variable of our own, so that the handlers' WORKER_DSN (which an application may read for
# its own connections) is left as the user set it.
RUN_DSN_ENV = "WORKER_RUN_DSN"
# Same as --console-host, names separated by commas.
CONSOLE_HOSTS_ENV = "WORKER_CONSOLE_HOSTS"
# Same as --otel (children of a supervisor get the flag with their command line anyway).
OTEL_ENV = "WORKER_OTEL"


def cmd_run(args: argparse.Namespace) -> int:
    # Before the import: a supervisor (or `worker demo`) killed meanwhile leaves no orphan.
    die_with_parent()
    _start_over(args)
    # Read once and out of the environment: handlers (and their subprocesses) do not see it.
    args.dsn = args.dsn or os.environ.pop(RUN_DSN_ENV, None)
    args.console_token = _console_token(args)
    args.console_hosts = _console_hosts(args)
    import_tasks(args.module)
    if args.otel or _env_flag(OTEL_ENV):
        _instrument()  # after the import: the tasks module may set up its tracer provider
    if len(registry) == 0:
        raise CliError(
            f"module {args.module!r} registered no tasks (decorate handlers with @worker.task)", 2
        )
    # Before any process starts: a supervisor's children would only fail the same way, again.
    check_results_config(
        WorkerConfig(
            dsn="",
            keep_done_seconds=args.keep_done,
            store_results=args.store_results,
            max_result_bytes=args.max_result_size,
        ),
        registry,
    )
    if not args.child:
        _warn_unknown_queues(args)
    dsn = resolve_dsn(args.dsn)
    if args.listen_dsn:
        checked_dsn(args.listen_dsn, "--listen-dsn" if "--listen-dsn" in args.argv else LISTEN_ENV)
    processes = args.processes or os.cpu_count() or 1
    if processes > 1 and not args.child:
        # Check the database and schema once, here, so a bad DSN is one clear line, not P of them.
        with connect_dsn(dsn) as conn:
            require(conn, args.schema)
        sup = Supervisor(
            child_command(args.argv),
            processes,
            grace_seconds=args.grace,
            stuck_seconds=args.stuck_after or max(60.0, args.lease * 2),
            start_seconds=args.start_timeout,
            burst=args.burst,
            dsn=dsn,
            schema=args.schema,
            # The DSN reaches the children through their environment, never their command line
            # (which every user of the machine can read with ps).
            env={RUN_DSN_ENV: dsn, **({LISTEN_ENV: args.listen_dsn} if args.listen_dsn else {})},
        )
        metrics = _start_metrics(args, dsn)
        if metrics is not None:
            sup.on_child_exit = metrics.child_exited
            sup.on_handed_back = metrics.handed_back
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
        keep_history=args.keep_history,
        store_results=args.store_results,
        max_result_bytes=args.max_result_size,
        burst=args.burst,
        exits_after_stop=True,  # this process ends with the worker
    )
    if args.child:
        _wait_for_database(dsn, args.schema)
    else:
        with connect_dsn(dsn) as conn:
            require(conn, args.schema)
    hooks = _worker_hooks(args)
    metrics = None if args.child else _start_metrics(args, dsn)
    worker = Worker(config, hooks=hooks)
    if args.child:
        _stop_with_parent(worker)

    def on_signal(signum: int, _frame: object) -> None:
        # A second signal stops at once, except a child's SIGTERM: under systemd (KillMode
        # control-group) a child gets SIGTERM from systemd and again from its supervisor, which
        # must not cut the grace period short. A supervisor says "at once" with SIGUSR1.
        now = signum == signal.SIGUSR1 or (
            worker.stopping and not (args.child and signum == signal.SIGTERM)
        )
        log.info(
            "received %s: %s",
            signal.Signals(signum).name,
            "handing back in-flight tasks at once"
            if now
            else f"finishing in-flight tasks (grace {args.grace:.0f}s)",
        )
        worker.stop(now=now)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    try:
        code = worker.run()
    finally:
        if metrics:
            metrics.stop()
    if args.report:
        _write_report(args.report, worker)
    return code


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise CliError(f"{name} must be 1 or 0 (true/false), not {value[:40]!r}", 2)


def _instrument() -> None:
    """Turn on worker.contrib.otel, imported only here: a worker run without --otel never loads
    OpenTelemetry."""
    try:
        otel = importlib.import_module("worker.contrib.otel")
    except ImportError as exc:
        raise CliError(
            f"--otel needs OpenTelemetry: pip install 'worker-pg[otel]' ({exc.name} is missing)", 2
        ) from None
    otel.instrument()


def _warn_unknown_queues(args: argparse.Namespace) -> None:
    """A queue in --queues that none of the module's tasks is routed to is most often a typo:
    the worker would wait on it forever while the tasks pile up in the queue they declare."""
    known = set(registry.queues()) | {DEFAULT_QUEUE}
    odd = [
        n for n in dict.fromkeys(q for q in (args.queues or "").split(",") if q) if n not in known
    ]
    if not odd:
        return
    # One line however many names: 200 typos are one mistake, not 200 log lines.
    names = ", ".join(repr(n[:100]) for n in odd[:5]) + (
        f" and {len(odd) - 5} more" if len(odd) > 5 else ""
    )
    shown = ", ".join(sorted(known)[:10]) + (", ..." if len(known) > 10 else "")
    log.warning(
        "--queues names %s, the queue of no task that %s registers (theirs: %s): only tasks a "
        "producer puts there explicitly will run; check the name",
        names,
        args.module,
        shown,
    )


def _start_over(args: argparse.Namespace) -> None:
    """A long-running `worker run` given --dsn (or --listen-dsn) on its command line, or the
    console's token in its environment, starts over without them (``common.start_over``): the
    DSNs move to its environment, the token to a pipe it reads once. The process keeps its pid;
    only its first moments show them. A DSN that cannot be parsed is refused first, by its flag.
    A supervised child takes neither (its supervisor never passes the token on)."""
    if args.child or not getattr(args, "from_command_line", False):
        return
    moved = {}
    if args.dsn and _given(args.argv, "--dsn"):
        moved[RUN_DSN_ENV] = checked_dsn(args.dsn, "--dsn")
    if args.listen_dsn and _given(args.argv, "--listen-dsn"):
        moved[LISTEN_ENV] = checked_dsn(args.listen_dsn, "--listen-dsn")
    argv = without_options(args.argv, DSN_OPTIONS) if moved else args.argv
    start_over(argv, moved, serving=bool(args.metrics_port))


def _console_token(args: argparse.Namespace) -> str | None:
    """The console's token, from --console-token-file, or handed over by ``_start_over`` from
    WORKER_CONSOLE_TOKEN (see ``common.console_token``). Only the process that serves the console
    (not a supervised child) keeps it."""
    path = getattr(args, "console_token_file", None)
    if path and not args.metrics_port and not args.child:
        raise CliError("--console-token-file needs --metrics-port: the console is served there", 2)
    return console_token(path, serving=bool(args.metrics_port) and not args.child)


def _given(argv: list[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in argv)


def _write_report(path: str, worker: Any) -> None:
    """Benchmark marks of this process, appended as one JSON line (several processes share it)."""
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


def _stop_with_parent(worker: Any) -> None:
    """A supervised child stops gracefully when its supervisor is gone (killed with SIGKILL, say).
    Children run in their own sessions, so nothing else would stop them: they would work on
    unsupervised, next to the pool of a restarted supervisor."""
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
    liveness = os.environ.get(LIVENESS_ENV)
    parent = os.getppid()
    delay = 0.5
    while os.getppid() == parent:  # no waiting on for a supervisor that is gone
        try:
            with connect(dsn, CLI) as conn:
                require(conn, schema)
            OUTAGE.back("start")
            return
        except psycopg.OperationalError as exc:
            OUTAGE.lost("start", exc)
        if liveness:
            os.utime(liveness)
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
    raise CliError("the supervisor is gone; not starting", 1)


def _worker_hooks(args: argparse.Namespace) -> Any:
    """Metrics hooks when metrics are on; plain hooks otherwise."""
    # Children inherit --metrics-port in their argv: they count, and the supervisor serves.
    return worker_hooks(enabled=bool(args.metrics_port))


def _start_metrics(args: argparse.Namespace, dsn: str) -> Any:
    if not args.metrics_port:
        return None
    # Under a supervisor (the same test as in cmd_run) the server must exist before the children
    # do: it creates the PROMETHEUS_MULTIPROC_DIR they inherit and aggregate their counts through.
    supervised = not args.child and (args.processes or os.cpu_count() or 1) > 1
    return serve(
        args.metrics_host,
        args.metrics_port,
        dsn=dsn,
        schema=args.schema,
        multiprocess=supervised,
        console_token=getattr(args, "console_token", None),
        console_hosts=getattr(args, "console_hosts", ()),
    )


def _console_hosts(args: argparse.Namespace) -> list[str]:
    """--console-host, else WORKER_CONSOLE_HOSTS (either: names separated by commas), checked."""
    given = getattr(args, "console_host", None)
    source = "--console-host" if given else CONSOLE_HOSTS_ENV
    texts = given or [os.environ.get(CONSOLE_HOSTS_ENV, "")]
    names = [n.strip() for text in texts for n in text.split(",") if n.strip()]
    for name in names:
        if split_host(name) is None:
            raise CliError(f"{source}: {name[:100]!r} is not a host name (NAME or NAME:PORT)", 2)
    return names
