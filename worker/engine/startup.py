"""What a worker process sets up before its loop runs, and in what order.

``assemble`` builds the parts of a ``Worker`` around its job table and inbox: the batcher (what
to claim, from where), the runner threads, the lease keeper, maintenance, the listener behind
PgBouncer and the claim loop's own connection. ``register`` then checks the schema, records the
limits the code declares, writes the worker's row and its tasks' routes, and makes the rows its
handlers can now take due at once. ``start`` and ``stop`` run the services in order and in
reverse.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import psycopg

from .. import store
from ..coord.cron import make_ticker
from ..db.connect import CLAIM, OwnConnection
from ..db.migrate import require_schema
from ..db.sql import cancel_channel, notify_channel
from ..tasks import limits as flow
from ..tasks import results, routes
from ..tasks.registry import Registry
from .batch import Batcher
from .lease import LeaseKeeper
from .listener import Listener
from .maintenance import Maintenance, MaintenanceConfig
from .runners import Executor
from .transactional import InTransaction
from .vacuum import Vacuumer

if TYPE_CHECKING:
    from .loop import Worker

log = logging.getLogger("worker")


class Service(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


@dataclass
class Parts:
    batcher: Batcher
    executor: Executor
    lease: LeaseKeeper
    maintenance: Maintenance
    listener: Listener | None
    conn: OwnConnection  # the claim loop's own connection


def handler_attempts(registry: Registry) -> dict[str, int]:
    """max_attempts per task, for rows whose producer left it to the handler (store.claim)."""
    return {name: d.max_attempts for name in registry.names() if (d := registry.get(name))}


def assemble(w: Worker) -> Parts:
    """The parts of ``w``, wired to its table, inbox and callbacks."""
    cfg = w.config
    events = w.events
    # LISTEN for new rows and for cancel requests: on the claim connection, or behind PgBouncer
    # in transaction mode on the listener's own (listen_dsn); neither: poll.
    channels = {
        notify_channel(cfg.schema): lambda p: events.put(("notify", p)),
        cancel_channel(cfg.schema): w.cancel_notified,
    }
    listener = None
    if cfg.listen and cfg.listen_dsn:
        listener = Listener(cfg.listen_dsn, channels)
    listens_here = cfg.listen and not cfg.listen_dsn

    def listen(conn: psycopg.Connection) -> None:
        """The claim connection was made: LISTEN on it. If it breaks while the loop sleeps, the
        loop claims at once, which connects again (see engine.inbox)."""
        events.listen(conn, channels, on_lost=lambda: events.put(("notify", None)))

    batcher = Batcher(
        w.q,
        w.id,
        queues=w.queues,
        batch_size=cfg.batch_size,
        lease_seconds=cfg.lease_seconds,
        delete_done=cfg.keep_done_seconds <= 0,
        move_done=cfg.keep_history,
        max_attempts=handler_attempts(w.registry),
        poll_interval=cfg.poll_interval,
        channel=notify_channel(cfg.schema),
        done_channel=results.done_channel(cfg.schema),
        stores_result=w.stores_result,
    )
    in_transaction = InTransaction(
        lambda: w.pool,
        schema=cfg.schema,
        worker_id=w.id,
        context=w.context,
        stores_result=w.stores_result,
        max_result_bytes=cfg.max_result_bytes,
        move=cfg.keep_history and cfg.keep_done_seconds > 0,
    )
    executor = Executor(
        cfg.concurrency,
        events,
        context=w.context,
        transactional=in_transaction,
        stores_result=w.stores_result,
        max_result_bytes=cfg.max_result_bytes,
    )
    lease = LeaseKeeper(
        cfg.dsn,
        w.q,
        worker_id=w.id,
        lease_seconds=cfg.lease_seconds,
        interval=cfg.heartbeat_seconds,
        leased=w.table.leased,
        on_lost=lambda ids: events.put(("lost", ids)),
        prepare=cfg.prepare,
        running=w.table.running_ids,
        on_cancel=lambda ids: events.put(("cancel", ids)),
        polling=lambda: not w.listening,
    )
    maintenance = Maintenance(
        cfg.dsn,
        w.q,
        MaintenanceConfig(
            rescue_seconds=cfg.rescue_seconds,
            purge_seconds=cfg.purge_interval,
            keep_done_seconds=cfg.keep_done_seconds,
            keep_failed_seconds=cfg.keep_failed_seconds,
            cron_keep_seconds=cfg.cron_keep_seconds,
        ),
        counted=w.counted,
        on_rescued=w.rescued,
        on_cron=w.cron_enqueued,
        # Never offer a slot older than cron rows are kept: a purged slot could run again.
        cron=make_ticker(cfg.schema, horizon_seconds=cfg.cron_keep_seconds),
        probe=w.probe,
        notified=lambda: w.listening,
        vacuum=Vacuumer(w.q, cfg.schema),
        prepare=cfg.prepare,
    )
    conn = OwnConnection(
        cfg.dsn, CLAIM, session=cfg.prepare, on_connect=listen if listens_here else None
    )
    return Parts(batcher, executor, lease, maintenance, listener, conn)


def register(conn: psycopg.Connection, w: Worker) -> None:
    """Before the first claim: the schema is current, the declared limits are recorded, and the
    worker's row, its tasks' routes and the rows of its tasks handed back by workers without the
    handler are written (the last made due at once)."""
    cfg = w.config
    if cfg.check_schema:
        require_schema(conn, cfg.schema)
    # Flow control (schema/0014): the claims learn which queues are limited (Batcher.claim).
    flow.declare(conn, cfg.schema, w.registry.limits, by=f"worker {w.id[:8]}")
    tasks = routes.of(w.registry)
    conn.execute(
        w.q["register"],
        {
            "worker_id": w.id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queues": w.queues,
            "concurrency": cfg.concurrency,
            "tasks": list(tasks),
        },
    )
    # The queue of each task, so that rows inserted without one land where a worker of that
    # task looks; then the rows of its tasks that were handed back are due at once.
    routes.record(conn, cfg.schema, tasks)
    store.wake_handed_back(conn, cfg.schema, list(tasks))


def start(services: Sequence[Service | None]) -> list[Service]:
    """Start each service in order; returns those started (to stop in reverse)."""
    started: list[Service] = []
    for service in services:
        if service is not None:
            service.start()
            started.append(service)
    return started


def stop(started: Sequence[Service]) -> None:
    for service in reversed(started):
        service.stop()


def describe(w: Any) -> None:
    cfg = w.config
    log.info(
        "worker %s started: queues=%s concurrency=%d batch=%d",
        w.id[:8],
        ",".join(w.queues),
        cfg.concurrency,
        cfg.batch_size,
    )


__all__ = ["Parts", "assemble", "describe", "handler_attempts", "register", "start"]
