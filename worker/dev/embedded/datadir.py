"""The files of an embedded server's data directory, read and written as its lifecycle needs:
the postmaster's pid file (is it running, on which port), the port kept across restarts, lock
files a dead postmaster left behind, and the server's log."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .install import _SYSTEM_PORT, EmbeddedError, _postgres_alive

log = logging.getLogger("worker.embedded")

STATE_FILE = "worker-embedded.json"
LOG_FILE = "server.log"
_LOG_ROTATE_BYTES = 10 * 1024 * 1024
_LOG_TAIL_LINES = 40
_LOG_LEVEL = re.compile(r"\b(PANIC|FATAL|ERROR):\s")


# sun_path holds 108 bytes with the NUL; PostgreSQL also creates "<socket>.lock" beside it.
_MAX_SOCKET_DIR_LEN = 107 - len("/.s.PGSQL.65535")
# Socket dirs go through pg_ctl's shell and PostgreSQL's list parsing: keep them boring.
_SHELL_SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+$")


class DataDir:
    """The data directory ``path`` of one cluster."""

    def __init__(self, path: Path) -> None:
        self.data_dir = path

    @property
    def log_path(self) -> Path:
        """Inside the data dir, so it goes wherever the cluster goes (and is removed with it)."""
        return self.data_dir / LOG_FILE

    @property
    def lock_path(self) -> Path:
        # Beside, not inside: initdb wants the data directory empty (or absent).
        return self.data_dir.parent / f".{self.data_dir.name}.lock"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        import fcntl  # POSIX only; imported here so the module still imports on Windows

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # A fresh open file description per call: flock then excludes other threads of this
        # process as well as other processes.
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.debug("waiting for %s (another start/stop is in progress)", self.lock_path)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    @property
    def socket_dir(self) -> Path:
        """The data dir, unless its path would overflow a unix socket address or the shell."""
        candidate = str(self.data_dir)
        if len(candidate) <= _MAX_SOCKET_DIR_LEN and _SHELL_SAFE_PATH.match(candidate):
            return self.data_dir
        digest = hashlib.sha256(candidate.encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"worker-pg-{digest}"

    @property
    def _state_path(self) -> Path:
        return self.data_dir / STATE_FILE

    def pidfile_lines(self) -> list[str]:
        try:
            return (self.data_dir / "postmaster.pid").read_text().splitlines()
        except (FileNotFoundError, NotADirectoryError):
            return []
        except PermissionError:
            raise EmbeddedError(
                f"cannot read {self.data_dir}: it belongs to another user (run as that user, or "
                "set WORKER_EMBEDDED_DIR to another folder)"
            ) from None

    def postmaster_pid(self) -> int | None:
        lines = self.pidfile_lines()
        if not lines:
            return None
        try:
            pid = int(lines[0].strip())
        except ValueError:
            return None
        return pid if _postgres_alive(pid, self.data_dir) else None

    def running_port(self) -> int | None:
        lines = self.pidfile_lines()
        if len(lines) < 4 or self.postmaster_pid() is None:
            return None
        try:
            return int(lines[3].strip())
        except ValueError:
            return None

    def read_state_port(self) -> int | None:
        try:
            state = json.loads(self._state_path.read_text())
            port = int(state["port"])
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring unreadable %s", self._state_path)
            return None
        except PermissionError:
            raise EmbeddedError(
                f"cannot read {self._state_path}: it belongs to another user"
            ) from None
        return port if 0 < port < 65536 and port != _SYSTEM_PORT else None

    def write_state_port(self, port: int) -> None:
        tmp = self._state_path.with_name(f".{STATE_FILE}.tmp")
        tmp.write_text(json.dumps({"port": port}) + "\n")
        os.replace(tmp, self._state_path)

    def clear_stale_lock_files(self, socket_dir: Path) -> None:
        """Remove lock files naming a postmaster that is a zombie or a recycled PID.

        PostgreSQL removes lock files of dead postmasters itself, but it judges "dead" with
        kill(pid, 0), which succeeds on a zombie or on an unrelated process that got the PID,
        and then refuses to start forever. Safe because PostgreSQL 12+ also guards against
        orphaned backends through the shared memory key derived from the data directory.
        """
        lines = self.pidfile_lines()
        if not lines or not Path("/proc/self/stat").exists():
            return
        try:
            pid = int(lines[0].strip())
        except ValueError:
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # truly gone: PostgreSQL copes on its own
        except PermissionError:
            pass
        if _postgres_alive(pid, self.data_dir):
            return
        log.warning("removing stale postmaster.pid of PID %d (zombie or reused PID)", pid)
        stale = [self.data_dir / "postmaster.pid"]
        if len(lines) >= 4 and lines[3].strip().isdigit():
            stale.append(socket_dir / f".s.PGSQL.{lines[3].strip()}.lock")
        for path in stale:
            with contextlib.suppress(OSError):
                if path.read_text().split("\n", 1)[0].strip() == str(pid):
                    path.unlink()

    def rotate_log(self) -> None:
        try:
            if self.log_path.stat().st_size > _LOG_ROTATE_BYTES:
                os.replace(self.log_path, self.log_path.with_name(LOG_FILE + ".1"))
        except FileNotFoundError:
            pass

    def log_since(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(offset if offset <= size else 0)
                text = fh.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-_LOG_TAIL_LINES:])


def dsn_for(port: int) -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def cause(log_tail: str) -> str:
    """The most telling log line: the last FATAL/PANIC/ERROR, without its timestamp prefix."""
    best = ""
    for line in log_tail.splitlines():
        match = _LOG_LEVEL.search(line)
        if match:
            best = line[match.start() :].strip()
    return best


def default_data_dir() -> Path:
    """``$WORKER_EMBEDDED_DIR``, else ``$XDG_DATA_HOME/worker/pgdata`` (``~/.local/share`` when
    XDG_DATA_HOME is unset or not absolute, as the XDG spec says): one server per user, so every
    folder and every venv of that user finds the same queue."""
    configured = os.environ.get("WORKER_EMBEDDED_DIR")
    if configured:
        return Path(configured).expanduser().absolute()
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "worker" / "pgdata"


__all__ = ["LOG_FILE", "STATE_FILE", "DataDir", "cause", "default_data_dir", "dsn_for", "text"]
