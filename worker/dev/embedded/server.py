"""A private PostgreSQL server for when the user gives no DSN (the CLI and the test suite).

The point is zero setup: the ``embedded`` extra (``pip install 'worker-pg[embedded]'``) brings the
``pgserver`` wheel, whose PostgreSQL binaries we drive directly with ``initdb``/``pg_ctl`` (without
it, a PostgreSQL installed on the machine; production installs and the image need neither, they
are given a DSN). We do not import ``pgserver`` itself:
importing it creates runtime directories and registers atexit hooks that stop servers we want
to outlive the process.

The server listens on 127.0.0.1 only, with trust authentication, so the DSN carries no secret.
Its port is chosen once and kept in a small JSON file inside the data directory, so a DSN that
was printed or written into a config stays valid across restarts.

``EmbeddedPostgres`` is one lifecycle (create, start, adopt a running server, stop, restart)
under one lock file. The files it reads and writes are ``datadir``'s; finding binaries and the
run-as user are ``install``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import stat
import subprocess
import time
from pathlib import Path

from . import datadir
from .datadir import DataDir, default_data_dir, dsn_for, text
from .install import (
    EmbeddedError,
    _chown_tree,
    _ensure_readable_tree,
    _ensure_traversable,
    _find_install,
    _Install,
    _pick_free_port,
    _port_is_free,
    _run_as_user,
    _RunAs,
    find_pg_bin,
)

__all__ = [
    "EmbeddedError",
    "EmbeddedPostgres",
    "default_data_dir",
    "ensure_embedded",
    "find_pg_bin",
]

log = logging.getLogger("worker.embedded")


_START_TIMEOUT = 60  # seconds pg_ctl waits for the server to accept connections
_PORT_TROUBLE = ("Address already in use", "could not bind", "could not create any TCP/IP")


class EmbeddedPostgres:
    """One PostgreSQL cluster in ``data_dir``, started on demand and left running.

    Every method may be called from several threads or processes at once: they serialise on
    an ``fcntl`` lock file beside the data directory, so two CLIs started together share one
    server instead of racing ``initdb``. The server outlives this object and this process (it
    is a daemon); call :meth:`stop` to end it.
    """

    def __init__(self, data_dir: Path, *, durable: bool = True) -> None:
        # Absolute because the tools run with cwd="/" (the server user may not be able to
        # read our cwd, and PostgreSQL resolves -D relative to it).
        self.data_dir = Path(data_dir).expanduser().absolute()
        self.durable = durable
        self.files = DataDir(self.data_dir)
        self._install: _Install | None = None
        # What the last start() did: "running" (found it up), "started" or "created". The CLI
        # says it in its one line about the server; the log says it only at DEBUG.
        self.last_start: str | None = None

    def __repr__(self) -> str:
        return f"EmbeddedPostgres({str(self.data_dir)!r}, durable={self.durable})"

    # ----------------------------------------------------------------- paths

    @property
    def log_path(self) -> Path:
        return self.files.log_path

    @property
    def socket_dir(self) -> Path:
        """The data dir, unless its path would overflow a unix socket address or the shell."""
        return self.files.socket_dir

    # ----------------------------------------------------------------- public API

    @property
    def dsn(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres``; stable across restarts."""
        port = self.files.running_port() or self.files.read_state_port()
        if port is None:
            raise EmbeddedError(
                f"embedded PostgreSQL in {self.data_dir} was never initialised: call start()"
            )
        return dsn_for(port)

    def is_running(self) -> bool:
        """Judged from postmaster.pid and the process table, not by connecting, so it is cheap
        and does not wait on a server that is still starting."""
        return self.files.postmaster_pid() is not None

    def start(self) -> str:
        """Create the cluster if needed, start it if it is not running, and return its DSN."""
        if os.name == "nt":
            raise EmbeddedError(
                "the embedded PostgreSQL server is not supported on Windows: set WORKER_DSN"
            )
        with self._locked():
            return self._start_locked()

    def stop(self) -> None:
        """Fast shutdown (rolls back open transactions); nothing to do if it is not running."""
        if not self.data_dir.is_dir():
            return  # never created: do not leave a lock file behind either
        with self._locked():
            self._stop_locked()

    def restart(self) -> None:
        """Stop then start under one lock, so no other process slips a start in between."""
        with self._locked():
            self._stop_locked()
            self._start_locked()

    # ----------------------------------------------------------------- locking

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return self.files.locked()

    # ----------------------------------------------------------------- internals

    def _bins(self) -> _Install:
        if self._install is None:
            self._install = _find_install()
        return self._install

    def _env(self) -> dict[str, str]:
        # PG* variables (PGDATA, PGPORT, ...) would silently retarget the tools; C messages
        # keep the log parseable ("Address already in use").
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        env["LANG"] = "C"
        return env

    def _run(
        self, argv: list[str], user: _RunAs | None, *, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, object] = {}
        if user is not None:
            kwargs = {"user": user.uid, "group": user.gid, "extra_groups": []}
        log.debug("running %s", " ".join(shlex.quote(a) for a in argv))
        try:
            return subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                cwd="/",
                env=self._env(),
                timeout=timeout,
                check=False,
                **kwargs,  # type: ignore[arg-type]
            )
        except subprocess.TimeoutExpired as exc:
            raise EmbeddedError(
                f"{Path(argv[0]).name} did not finish within {timeout:.0f}s; see {self.log_path}",
                detail=text(exc.stdout) + text(exc.stderr),
                log_path=self.log_path,
            ) from None
        except OSError as exc:
            raise EmbeddedError(f"cannot run {argv[0]}: {exc}") from None

    def _prepare_dirs(self, user: _RunAs | None, install: _Install) -> None:
        fresh = not self.data_dir.exists()
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        sock = self.socket_dir
        if sock != self.data_dir:
            # A short path in the shared temp folder: refuse one someone else planted.
            sock.mkdir(mode=0o700, exist_ok=True)
            st = sock.lstat()
            allowed = {os.geteuid()} | ({user.uid} if user is not None else set())
            if not stat.S_ISDIR(st.st_mode) or st.st_uid not in allowed:
                raise EmbeddedError(f"socket folder {sock} belongs to another user: remove it")
        if user is None:
            return
        for path in (self.data_dir, sock):
            if path.stat().st_uid != user.uid:
                if fresh or path == sock or not any(path.iterdir()):
                    os.chown(path, user.uid, user.gid)
                else:
                    _chown_tree(path, user)
            _ensure_traversable(path.parent, user)
        _ensure_traversable(install.bin_dir, user)
        for folder in install.private_tree:
            _ensure_readable_tree(folder, user)

    def _initdb_if_needed(self, user: _RunAs | None, install: _Install) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            if self.files.read_state_port() is None:
                # A cluster made elsewhere (or before the state file existed): adopt it.
                self.files.write_state_port(_pick_free_port())
            return
        leftovers = [p.name for p in self.data_dir.iterdir()]
        if leftovers:
            raise EmbeddedError(
                f"{self.data_dir} is not empty and holds no PostgreSQL cluster: remove it or "
                "set WORKER_EMBEDDED_DIR to another folder"
            )
        log.debug("creating embedded PostgreSQL cluster in %s", self.data_dir)
        self.last_start = "created"
        done = self._run(
            [
                str(install.bin_dir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-instructions",
            ],
            user,
            timeout=300,
        )
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip()
            cause = output.splitlines()[-1] if output else f"exit code {done.returncode}"
            raise EmbeddedError(
                f"initdb failed for {self.data_dir}: {cause}",
                detail=done.stdout + done.stderr,
            )
        # Written last: the port is part of what a successfully created cluster has.
        self.files.write_state_port(_pick_free_port())

    def _start_locked(self) -> str:
        port = self.files.running_port()
        if port is not None:
            self.last_start = "running"
            return dsn_for(port)
        self.last_start = "started"
        install = self._bins()
        user = _run_as_user()
        self._prepare_dirs(user, install)
        self._initdb_if_needed(user, install)
        self.files.rotate_log()
        self.files.clear_stale_lock_files(self.socket_dir)

        port = self.files.read_state_port() or _pick_free_port()
        for attempt in range(3):
            if not _port_is_free(port):
                new = _pick_free_port()
                log.warning("port %d is taken; the embedded server moves to %d", port, new)
                port = new
            self.files.write_state_port(port)
            try:
                self._pg_ctl_start(port, user, install)
            except _PortTaken:
                if attempt == 2:
                    raise
                continue
            log.debug("embedded PostgreSQL running on 127.0.0.1:%d (%s)", port, self.data_dir)
            return dsn_for(port)
        raise AssertionError("unreachable")

    def _server_options(self, port: int) -> list[str]:
        settings = {
            "port": str(port),
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.socket_dir),
            "max_connections": "300",
        }
        if not self.durable:
            # Throwaway test clusters: a crash may corrupt them, and that is fine.
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        options: list[str] = []
        for name, value in settings.items():
            options += ["-c", f"{name}={value}"]
        return options

    def _pg_ctl_start(self, port: int, user: _RunAs | None, install: _Install) -> None:
        try:
            offset = self.log_path.stat().st_size
        except FileNotFoundError:
            offset = 0
        # pg_ctl hands -o to /bin/sh, hence the quoting.
        options = " ".join(shlex.quote(o) for o in self._server_options(port))
        done = self._run(
            [
                str(install.bin_dir / "pg_ctl"),
                "start",
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_path),
                "-w",
                "-t",
                str(_START_TIMEOUT),
                "-o",
                options,
            ],
            user,
            timeout=_START_TIMEOUT + 30,
        )
        if done.returncode == 0 and self.files.postmaster_pid() is not None:
            return
        tail = self.files.log_since(offset)
        tool_output = (done.stderr + done.stdout).strip()
        cause = datadir.cause(tail) or (tool_output.splitlines() or [""])[-1]
        if not cause:
            cause = f"pg_ctl exited with code {done.returncode}"
        detail = "\n".join(part for part in (tail, tool_output) if part)
        if any(marker in detail for marker in _PORT_TROUBLE):
            raise _PortTaken(
                f"embedded PostgreSQL could not listen on 127.0.0.1:{port}: {cause}; "
                f"see {self.log_path}",
                detail=detail,
                log_path=self.log_path,
            )
        raise EmbeddedError(
            f"embedded PostgreSQL failed to start: {cause}; see {self.log_path}",
            detail=detail,
            log_path=self.log_path,
        )

    def _stop_locked(self) -> None:
        if self.files.postmaster_pid() is None:
            return
        install = self._bins()
        user = _run_as_user()
        done = self._run(
            [
                str(install.bin_dir / "pg_ctl"),
                "stop",
                "-D",
                str(self.data_dir),
                "-m",
                "fast",
                "-w",
                "-t",
                str(_START_TIMEOUT),
            ],
            user,
            timeout=_START_TIMEOUT + 30,
        )
        if done.returncode != 0 and self.files.postmaster_pid() is not None:
            output = (done.stderr + done.stdout).strip()
            cause = output.splitlines()[-1] if output else f"exit code {done.returncode}"
            raise EmbeddedError(
                f"embedded PostgreSQL did not stop: {cause}; see {self.log_path}",
                detail=output,
                log_path=self.log_path,
            )
        self._wait_gone()
        log.debug("embedded PostgreSQL in %s stopped", self.data_dir)

    def _wait_gone(self, timeout: float = 10.0) -> None:
        # pg_ctl -w returns once postmaster.pid is gone; the process may linger a moment
        # more, and a start() right after must not see it as alive.
        deadline = time.monotonic() + timeout
        while self.files.postmaster_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.05)


class _PortTaken(EmbeddedError):
    """Raised inside start() so it can retry on another port; escapes only after retries."""


# --------------------------------------------------------------------------- helpers


def ensure_embedded(data_dir: Path | None = None) -> str:
    """Start (creating if needed) the embedded server and return its DSN."""
    return EmbeddedPostgres(data_dir if data_dir is not None else default_data_dir()).start()
