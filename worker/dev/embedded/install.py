"""Where the embedded server's PostgreSQL comes from and whom it runs as.

Finds ``initdb``/``pg_ctl``/``postgres`` (``WORKER_PG_BIN`` first, then the ``pgserver`` wheel
that the ``embedded`` extra installs, then ``PATH`` and the usual system folders), hands the data
folder to an unprivileged system user when we run as root (PostgreSQL refuses root), and picks
free local ports. ``embedded`` drives the server with what this module finds.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pwd

log = logging.getLogger("worker.embedded")

DEFAULT_RUN_USER = "worker-pg"
_TOOLS = ("initdb", "pg_ctl", "postgres")
_SYSTEM_PORT = 5432  # a system PostgreSQL may own it; never hand it out


class EmbeddedError(RuntimeError):
    """The embedded server could not be found, created, started or stopped.

    ``str(err)`` is one line meant for a terminal; ``detail`` holds what a human debugging it
    wants (the tail of the server log, tool output) without flooding the CLI's error line.
    """

    def __init__(self, message: str, *, detail: str = "", log_path: Path | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.detail = detail
        self.log_path = log_path


EXTRA = "worker-pg[embedded]"


class EmbeddedUnavailable(EmbeddedError):
    """No PostgreSQL binaries at all: the ``embedded`` extra (the ``pgserver`` wheel) is not
    installed and the machine has no PostgreSQL of its own. The CLI exits 2 on it, as on other
    configuration errors."""


# --------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class _Install:
    bin_dir: Path
    # Folders pgserver's binaries read at run time (bin, lib, share, the auditwheel libs). When
    # root hands the server to an unprivileged user we make these readable by it. Empty for
    # other installs: walking e.g. /usr/lib to "fix" it would loosen files on purpose private.
    private_tree: tuple[Path, ...] = ()


def _has_tools(folder: Path) -> bool:
    return all(os.access(folder / tool, os.X_OK) and (folder / tool).is_file() for tool in _TOOLS)


def _pgserver_install() -> _Install | None:
    # find_spec on a top-level name locates the package without executing its __init__.
    try:
        spec = importlib.util.find_spec("pgserver")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        prefix = Path(location) / "pginstall"
        if _has_tools(prefix / "bin"):
            # auditwheel moves bundled shared libraries to a sibling "pgserver.libs" folder.
            extra = Path(location).parent / "pgserver.libs"
            dirs = [prefix / "bin", prefix / "lib", prefix / "share", extra]
            return _Install(prefix / "bin", tuple(d for d in dirs if d.is_dir()))
    return None


def _version_key(path: str) -> tuple[int, ...]:
    name = Path(path).parent.name
    return tuple(int(part) for part in name.split(".") if part.isdigit()) or (0,)


def _find_install() -> _Install:
    override = os.environ.get("WORKER_PG_BIN")
    if override:
        folder = Path(override).expanduser().absolute()
        if not _has_tools(folder):
            raise EmbeddedError(
                f"WORKER_PG_BIN={override} has no initdb/pg_ctl/postgres: point it at a "
                "PostgreSQL bin folder, or unset it, or set WORKER_DSN to use a server"
            )
        return _Install(folder)

    found = _pgserver_install()
    if found is not None:
        return found

    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        # Distribution wrappers and /usr/local/bin symlinks: pg_ctl looks for "postgres"
        # next to its real location, so use the resolved folder.
        folder = Path(initdb).resolve().parent
        if _has_tools(folder):
            return _Install(folder)

    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True):
        if _has_tools(Path(candidate)):
            return _Install(Path(candidate))

    raise EmbeddedUnavailable(
        f"the embedded PostgreSQL is not installed: pip install '{EXTRA}' (or set WORKER_PG_BIN "
        "to a PostgreSQL bin folder), or set WORKER_DSN to use a server of yours"
    )


def find_pg_bin() -> Path:
    """The folder holding ``initdb``/``pg_ctl``/``postgres`` that the embedded server uses.

    Exposed so the CLI can print it in diagnostics; raises :class:`EmbeddedError` if none.
    """
    return _find_install().bin_dir


# --------------------------------------------------------------------------- running as root


@dataclass(frozen=True)
class _RunAs:
    name: str
    uid: int
    gid: int

    def can_traverse(self, st: os.stat_result) -> bool:
        return bool(st.st_mode & self._class_bit(st, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH))

    def _class_bit(self, st: os.stat_result, usr: int, grp: int, oth: int) -> int:
        # Permission checks use exactly one class: owner, else group, else other.
        if st.st_uid == self.uid:
            return usr
        if st.st_gid == self.gid:  # we drop supplementary groups, so only the primary counts
            return grp
        return oth

    def grant(self, path: Path, st: os.stat_result, *, read: bool, execute: bool) -> None:
        """Add the missing read/execute bits for this user's class; never adds write."""
        want = 0
        if read:
            want |= self._class_bit(st, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)
        if execute:
            want |= self._class_bit(st, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)
        if st.st_mode & want != want:
            mode = stat.S_IMODE(st.st_mode) | want
            log.debug("chmod %o %s so %s can use it", mode, path, self.name)
            os.chmod(path, mode)


def _run_as_user() -> _RunAs | None:
    """PostgreSQL refuses to run as root, so root hands the server to an unprivileged user."""
    if os.geteuid() != 0:
        return None
    import pwd

    name = os.environ.get("WORKER_EMBEDDED_USER") or DEFAULT_RUN_USER
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if name != DEFAULT_RUN_USER:
            raise EmbeddedError(
                f"WORKER_EMBEDDED_USER={name} does not exist: create it, or unset it to let "
                f"worker create {DEFAULT_RUN_USER}"
            ) from None
        entry = _create_user(name)
    if entry.pw_uid == 0:
        raise EmbeddedError(
            f"user {name} is root and PostgreSQL refuses to run as root: set "
            "WORKER_EMBEDDED_USER to an unprivileged user"
        )
    return _RunAs(name, entry.pw_uid, entry.pw_gid)


def _create_user(name: str) -> pwd.struct_passwd:
    import fcntl
    import pwd

    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    argv = [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
    # One process at a time: two useradd runs at once (two test processes starting together on a
    # new machine) both succeeded, and the second rewrote the user with other ids after the first
    # had handed its data folder to the first ones.
    lock_path = Path(tempfile.gettempdir()) / f"worker-useradd-{name}.lock"
    try:
        lock = open(lock_path, "a")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise EmbeddedError(
            f"running as root needs an unprivileged user, and creating it needs the lock file "
            f"{lock_path} ({exc.strerror}): create the user and set WORKER_EMBEDDED_USER, or set "
            "WORKER_DSN to use a server"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return pwd.getpwnam(name)  # created by another process while we waited
        except KeyError:
            pass
        log.debug("creating system user %s to run the embedded PostgreSQL as", name)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise EmbeddedError(
                f"running as root needs an unprivileged user and useradd failed ({exc}): create "
                "one and set WORKER_EMBEDDED_USER, or set WORKER_DSN to use a server"
            ) from None
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise EmbeddedError(
            f"running as root needs an unprivileged user and `useradd {name}` failed: create "
            "one and set WORKER_EMBEDDED_USER, or set WORKER_DSN to use a server",
            detail=done.stderr,
        ) from None


def _ensure_traversable(path: Path, user: _RunAs) -> None:
    """Let ``user`` reach ``path`` by adding search permission only where it is missing."""
    for folder in (path, *path.parents):
        try:
            st = folder.stat()
        except FileNotFoundError:
            continue
        if not user.can_traverse(st):
            user.grant(folder, st, read=False, execute=True)


_readable_trees: set[tuple[Path, int]] = set()


def _ensure_readable_tree(root: Path, user: _RunAs) -> None:
    """Installed files are normally world-readable, but umask 077 installs are not: fix once."""
    key = (root, user.uid)
    if key in _readable_trees:
        return
    _ensure_traversable(root, user)
    for dirpath, _dirnames, filenames in os.walk(root):
        folder = Path(dirpath)
        user.grant(folder, folder.stat(), read=True, execute=True)
        for filename in filenames:
            path = folder / filename
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            user.grant(path, st, read=True, execute=bool(st.st_mode & stat.S_IXUSR))
    _readable_trees.add(key)


def _chown_tree(root: Path, user: _RunAs) -> None:
    log.debug("handing %s to user %s", root, user.name)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            os.lchown(Path(dirpath) / name, user.uid, user.gid)
    os.chown(root, user.uid, user.gid)


# --------------------------------------------------------------------------- ports


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Same option PostgreSQL uses: connections lingering in TIME_WAIT from the previous
        # run must not count as "taken", or every restart would move the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port != _SYSTEM_PORT:
            return port


# --------------------------------------------------------------------------- process checks


def _postgres_alive(pid: int, data_dir: Path) -> bool:
    """A live postgres serving ``data_dir``: not a zombie, not a recycled PID.

    Zombies matter: in containers whose PID 1 does not reap (no ``--init``), a killed
    postmaster can linger as a zombie, and kill(pid, 0) still succeeds on it.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user (the unprivileged server user)
    if not Path("/proc/self/stat").exists():
        return True  # no procfs (macOS): trust kill()
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    comm = text[text.find("(") + 1 : text.rfind(")")]
    state = text[text.rfind(")") + 2 : text.rfind(")") + 3]
    if state in ("Z", "X") or not comm.startswith("postgres"):
        return False
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return True  # not ours to inspect (non-root looking at another user): trust it
    # Every postgres process chdirs into its data directory.
    return os.path.realpath(cwd) == os.path.realpath(data_dir)


# --------------------------------------------------------------------------- the server
