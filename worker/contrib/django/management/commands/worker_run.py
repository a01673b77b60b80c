"""``python manage.py worker_run``: a worker for the Django tasks of a ``WorkerBackend``.

It runs inside Django (settings loaded, apps ready), connects to the backend's database with the
connection settings of ``DATABASES`` (nothing on the command line), and finds each task by its
import path as rows arrive (``registry.DjangoRegistry``). Its options are the main ones of
``worker run``, with the same defaults; one process per command (run several for more).
"""

from __future__ import annotations

import logging
import signal
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError
from django.db import connections
from psycopg.conninfo import make_conninfo

from worker import ConfigError, SchemaMissing, Worker, WorkerConfig

from ...backend import WorkerBackend
from ...compat import task_backends
from ...registry import DjangoRegistry

log = logging.getLogger("worker")

# Connection parameters of Django's that are not libpq's (psycopg objects, Django's own).
_NOT_CONNINFO = {"context", "cursor_factory", "prepare_threshold", "server_side_binding"}


def _number(kind: type, low: float, high: float) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:
            raise ArgumentTypeError(f"must be between {low:g} and {high:g}, not {text}")
        return value

    return parse


def dsn_of(alias: str) -> str:
    """A libpq connection string for a Django database alias, from Django's own parameters
    (host, port, user, password, sslmode, service... as DATABASES gives them)."""
    params = connections[alias].get_connection_params()
    return make_conninfo(
        **{k: v for k, v in params.items() if k not in _NOT_CONNINFO and v not in (None, "")}
    )


class Command(BaseCommand):
    help = "Run a worker for the Django tasks enqueued through a worker.contrib.django backend."

    def add_arguments(self, parser: ArgumentParser) -> None:
        day = 86400.0
        parser.add_argument(
            "--backend", default="default", help="the TASKS alias to serve (default 'default')"
        )
        parser.add_argument(
            "--queues",
            help="comma-separated queues (default: the backend's QUEUES, else 'default')",
        )
        parser.add_argument("--concurrency", type=_number(int, 1, 1000), default=100)
        parser.add_argument("--batch-size", type=_number(int, 1, 10_000), default=100)
        parser.add_argument("--grace", type=_number(float, 0, day), default=30.0)
        parser.add_argument("--lease", type=_number(float, 0.5, day), default=30.0)
        parser.add_argument("--poll-interval", type=_number(float, 0.01, 3600), default=1.0)
        parser.add_argument("--no-listen", action="store_true", help="poll only")
        parser.add_argument(
            "--keep-done",
            type=_number(float, 0, 100 * 365 * day),
            default=3600.0,
            help="seconds to keep done rows, and so their results (default 3600; not 0)",
        )
        parser.add_argument(
            "--keep-failed", type=_number(float, 0, 100 * 365 * day), default=7 * day
        )
        parser.add_argument(
            "--max-result-size", type=_number(int, 1, 256 * 1024 * 1024), default=64 * 1024
        )
        parser.add_argument(
            "--burst", action="store_true", help="exit once no task is due and none is running"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias = options["backend"]
        try:
            backend = task_backends[alias]
        except Exception as exc:
            raise CommandError(f"--backend {alias!r}: {exc}", returncode=2) from None
        if not isinstance(backend, WorkerBackend):
            raise CommandError(
                f"TASKS[{alias!r}] is a {type(backend).__name__}, not "
                "worker.contrib.django.WorkerBackend",
                returncode=2,
            )
        if options["keep_done"] <= 0:
            # Django reads results from the done rows: deleting them at completion loses them.
            raise CommandError(
                "--keep-done must be above 0: Django's get_result() reads the done rows",
                returncode=2,
            )
        problem = backend._database_problem()
        if problem:
            raise CommandError(problem, returncode=2)
        queues = [q for q in (options["queues"] or "").split(",") if q]
        config = WorkerConfig(
            dsn=dsn_of(backend.database),
            schema=backend.schema,
            queues=queues or sorted(backend.queues) or ["default"],
            concurrency=options["concurrency"],
            batch_size=options["batch_size"],
            lease_seconds=options["lease"],
            poll_interval=options["poll_interval"],
            grace_seconds=options["grace"],
            listen=not options["no_listen"],
            keep_done_seconds=options["keep_done"],
            keep_failed_seconds=options["keep_failed"],
            max_result_bytes=options["max_result_size"],
            burst=options["burst"],
            exits_after_stop=True,  # this process ends with the worker
        )
        worker = Worker(config, DjangoRegistry())

        def on_signal(signum: int, _frame: object) -> None:
            # The first signal finishes in-flight tasks (within --grace); a second stops at once.
            log.info("received %s: stopping", signal.Signals(signum).name)
            worker.stop(now=worker.stopping)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.stderr.write(
            f"worker: serving Django tasks of TASKS[{alias!r}] from queues "
            f"{', '.join(worker.queues)} (schema {backend.schema})"
        )
        try:
            code = worker.run()
        except SchemaMissing as exc:  # the schema is missing or behind: `manage.py migrate`
            raise CommandError(str(backend.with_django_fix(exc)), returncode=2) from None
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=2) from None
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommandError(f"cannot reach the database: {first}", returncode=1) from None
        finally:  # call_command() runs this in a caller's process: give its handlers back
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if code:
            raise CommandError(f"the worker stopped with exit code {code}", returncode=code)
