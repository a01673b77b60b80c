"""The monitor's HTTP server: /metrics, /healthz, /readyz, the status page at / and the operator
console under /console/.

One server per machine (the supervisor's, or the single worker process's). /metrics and the
queue figures of the pages come from the cached read model (``readmodel.Database``) and the
registry of ``collector``; the console (``console.app``), which renders the status page too (its
overview without the actions), has its own connections for the charts, job pages and actions.
Connections are handled by ``httpd.BoundedServer``: idle and slow clients cost no thread, and
/healthz is answered on its loop, so it never waits for the database or a busy thread; each
request by ``handler.Handler``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..tasks.registry import registry
from .console.app import Console
from .console.auth import ConsoleAuth
from .console.data import ConsoleData
from .handler import Handler, healthz
from .hosts import HostCheck, HostError
from .httpd import BoundedServer
from .metrics.collector import build_registry, child_exited, prepare_multiprocess_dir
from .metrics.instruments import (
    COUNT_CAP_ENV,
    DEFAULT_COUNT_CAP,
    DEFAULT_TTL,
    MULTIPROC_ENV,
    TTL_ENV,
    UNREGISTERED,
    instruments,
)
from .metrics.journal import journal_paths, settle
from .readmodel import Database

log = logging.getLogger("worker.metrics")


class WebServer:
    """A ``BoundedServer`` whose loop runs on a daemon thread; ``stop()`` shuts it down."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: Database,
        registry: Any,
        console: Console,
        hosts: Sequence[str] = (),
        **limits: Any,
    ) -> None:
        try:
            HostCheck(host, port, hosts, machine=(set(), set()))  # a bad name, before binding
        except HostError as exc:
            raise ConfigError(f"--console-host: {exc}") from None
        handler = type(
            "Handler",
            (Handler,),
            {"db": db, "registry": registry, "console": console, "refused_hosts": set()},
        )
        try:
            self.httpd = BoundedServer((host, port), handler, inline=healthz, **limits)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} "
                "(is another process using --metrics-port?)"
            ) from None
        self.host = host
        self.port = int(self.httpd.server_address[1])
        handler.hosts = HostCheck(host, self.port, hosts)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="worker-metrics-http",
            daemon=True,
        )
        self.thread.start()
        log.info(
            "serving /metrics, /healthz, /readyz, the status page and the console (%s) on %s",
            "actions on" if console.auth.enabled else "read-only",
            self.where,
        )
        log.info(
            "the status page and the console answer requests for Host %s only (more with "
            "--console-host); /metrics, /healthz and /readyz for any",
            handler.hosts.describe(),
        )

    @property
    def url(self) -> str:
        """An address to open from this machine: the bound one, or 127.0.0.1 when the server
        listens on every address."""
        host = self.host if self.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/"

    @property
    def bound(self) -> str:
        """The address the socket is bound to, as the kernel reports it (``0.0.0.0:9470``)."""
        host = str(self.httpd.server_address[0])
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def where(self) -> str:
        """The start-up line's account of the address: what is bound, and where a wildcard
        address is reachable from (every interface, so not only this machine)."""
        host = str(self.httpd.server_address[0])
        if host in ("0.0.0.0", "::"):
            which = "IPv4 address" if host == "0.0.0.0" else "address"
            return f"{self.bound}, every {which} of this machine ({self.url} from it)"
        return f"{self.bound} ({self.url})"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.thread.join(timeout=5)


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value >= 0 else default


class MetricsServer:
    """What ``serve`` returns: the running HTTP server and what it owns."""

    def __init__(
        self,
        web: WebServer,
        db: Database,
        multiprocess_dir: str | None,
        previous_env: str | None = None,
        *,
        dsn: str = "",
        schema: str = "worker",
        console: Console | None = None,
    ) -> None:
        self.web = web
        self.db = db
        self.console = console
        self.multiprocess_dir = multiprocess_dir
        self._previous_env = previous_env
        self._dsn = dsn
        self._schema = schema

    def child_exited(self, pid: int) -> None:
        """The supervisor's callback for a child that is gone, however it went: drop its live
        gauges now, and settle its journal in the background (that may wait for the database)."""
        path = self.multiprocess_dir
        if not path:
            return
        child_exited(pid, path)
        if any(os.path.exists(p) for p in journal_paths(path, pid)):
            threading.Thread(
                target=self._settle, args=(pid, path), name=f"settle-{pid}", daemon=True
            ).start()

    def handed_back(self, rows: list[tuple[int, str, str, str]]) -> None:
        """The supervisor's callback for a dead child's rows it handed back: they count as
        rescued, and as failed when that was their last attempt (as a lease rescue would)."""
        m = instruments()
        for _id, queue, task, state in rows:
            key = (queue, task if registry.get(task) is not None else UNREGISTERED)
            m.rescued.labels(*key).inc()
            if state == "failed":
                m.failed.labels(*key).inc()

    def _settle(self, pid: int, path: str) -> None:
        try:
            settle(pid, path, self._dsn, self._schema)
        except Exception:
            log.exception("could not settle the metrics of worker pid %d", pid)

    @property
    def port(self) -> int:
        return self.web.port

    @property
    def url(self) -> str:
        return self.web.url

    def stop(self) -> None:
        self.web.stop()
        if self.console is not None:
            self.console.close()
        self.db.close()
        if self.multiprocess_dir:
            shutil.rmtree(self.multiprocess_dir, ignore_errors=True)
            if os.environ.get(MULTIPROC_ENV) == self.multiprocess_dir:
                _restore_env(self._previous_env)
            self.multiprocess_dir = None


def serve(
    host: str,
    port: int,
    *,
    dsn: str,
    schema: str,
    multiprocess: bool = False,
    ttl: float | None = None,
    count_cap: int | None = None,
    console_token: str | None = None,
    console_refresh: float = 5.0,
    console_hosts: Sequence[str] = (),
    **limits: Any,
) -> MetricsServer:
    """Serve /metrics, /healthz, /readyz, the status page at ``/`` and the console under
    ``/console/`` until ``stop()``.

    ``multiprocess``: this process is a supervisor whose children do the work; call it before the
    first child starts, so that they inherit a fresh PROMETHEUS_MULTIPROC_DIR.
    ``console_token``: the token that turns the console's actions on (None: read-only; see
    ``console.auth.checked_token``); ``console_refresh``: seconds between the console's
    auto-refreshes; ``console_hosts``: host names the page and the console answer besides the
    server's own (see ``hosts.HostCheck``). ``limits``: ``BoundedServer``'s (threads,
    max_connections, request_timeout, max_head, max_body).
    """
    db = Database(
        dsn,
        schema,
        ttl=_env_float(TTL_ENV, DEFAULT_TTL) if ttl is None else ttl,
        count_cap=count_cap or int(_env_float(COUNT_CAP_ENV, DEFAULT_COUNT_CAP)) or 1,
    )
    previous = os.environ.get(MULTIPROC_ENV)
    path = prepare_multiprocess_dir() if multiprocess else None
    console = Console(
        db,
        ConsoleData(dsn, schema, ttl=db.ttl),
        ConsoleAuth(console_token),
        refresh=console_refresh,
    )
    try:
        registry = build_registry(db, multiprocess_dir=path)
        web = WebServer(
            host, port, db=db, registry=registry, console=console, hosts=console_hosts, **limits
        )
    except BaseException:
        console.close()
        db.close()
        if path:
            shutil.rmtree(path, ignore_errors=True)
            _restore_env(previous)
        raise
    return MetricsServer(web, db, path, previous, dsn=dsn, schema=schema, console=console)


def _restore_env(previous: str | None) -> None:
    if previous is None:
        os.environ.pop(MULTIPROC_ENV, None)
    else:
        os.environ[MULTIPROC_ENV] = previous


__all__ = ["MetricsServer", "WebServer", "serve"]
