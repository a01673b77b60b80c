"""The embedded PostgreSQL server, against real ``initdb``/``pg_ctl`` binaries (no mocks).

Runs as root too: the module then hands the cluster to an unprivileged user, which is the
part most likely to break on CI machines and in containers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from worker.dev.embedded import (
    EmbeddedError,
    EmbeddedPostgres,
    EmbeddedUnavailable,
    ensure_embedded,
    find_pg_bin,
)
from worker.dev.embedded import install as pginstall

Factory = Callable[..., EmbeddedPostgres]


@pytest.fixture
def make_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Factory]:
    """Hands out servers in fresh folders and stops every one of them at teardown."""
    made: list[EmbeddedPostgres] = []

    def make(*, durable: bool = False, data_dir: Path | None = None) -> EmbeddedPostgres:
        folder = data_dir or tmp_path_factory.mktemp("embedded") / "pgdata"
        server = EmbeddedPostgres(folder, durable=durable)
        made.append(server)
        return server

    yield make
    errors = []
    for server in made:
        try:
            server.stop()
        except Exception as exc:
            errors.append(exc)
    assert not errors, errors


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(tmp_path_factory.mktemp("embedded-shared") / "pgdata", durable=False)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _port(dsn: str) -> int:
    return int(dsn.rsplit(":", 1)[1].split("/", 1)[0])


def test_start_serves_queries(shared_server: EmbeddedPostgres) -> None:
    dsn = shared_server.start()
    assert dsn == shared_server.dsn
    assert dsn.startswith("postgresql://postgres@127.0.0.1:")
    assert _port(dsn) != 5432
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        user, encoding = conn.execute(
            "select current_user, pg_encoding_to_char(encoding) from pg_database"
            " where datname = current_database()"
        ).fetchone()
        assert (user, encoding) == ("postgres", "UTF8")


def test_server_settings(shared_server: EmbeddedPostgres) -> None:
    with psycopg.connect(shared_server.dsn) as conn:
        show = {
            name: conn.execute(f"show {name}").fetchone()[0]
            for name in (
                "max_connections",
                "listen_addresses",
                "fsync",
                "synchronous_commit",
                "full_page_writes",
            )
        }
    assert show == {
        "max_connections": "300",
        "listen_addresses": "127.0.0.1",
        "fsync": "off",
        "synchronous_commit": "off",
        "full_page_writes": "off",
    }


def test_start_is_idempotent(shared_server: EmbeddedPostgres) -> None:
    first = shared_server.start()
    again = EmbeddedPostgres(shared_server.data_dir).start()
    assert first == again
    assert shared_server.is_running()


def test_durable_server_keeps_fsync(make_server: Factory) -> None:
    server = make_server(durable=True)
    with psycopg.connect(server.start()) as conn:
        assert conn.execute("show fsync").fetchone() == ("on",)
        assert conn.execute("show synchronous_commit").fetchone() == ("on",)


def test_stop_start_keeps_port_and_data(make_server: Factory) -> None:
    server = make_server()
    dsn = server.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table kept (v text)")
        conn.execute("insert into kept values ('still here')")

    server.stop()
    assert not server.is_running()
    assert server.dsn == dsn  # known from the state file while stopped
    server.stop()  # stopping a stopped server is fine

    assert server.start() == dsn
    assert server.is_running()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select v from kept").fetchall() == [("still here",)]


def test_restart(make_server: Factory) -> None:
    server = make_server()
    dsn = server.start()
    with psycopg.connect(dsn) as conn:
        before = conn.execute("select pg_postmaster_start_time()").fetchone()[0]
    server.restart()
    assert server.is_running()
    assert server.dsn == dsn
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select pg_postmaster_start_time()").fetchone()[0] > before


def test_taken_port_moves_and_is_persisted(make_server: Factory) -> None:
    server = make_server()
    old = _port(server.start())
    server.stop()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", old))
        squatter.listen()
        dsn = server.start()
        assert _port(dsn) != old
        with psycopg.connect(dsn) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
    server.stop()
    assert server.start() == dsn  # the new port was persisted


def test_stop_never_started_is_noop(tmp_path: Path) -> None:
    server = EmbeddedPostgres(tmp_path / "nothing")
    server.stop()
    assert not server.is_running()
    with pytest.raises(EmbeddedError):
        _ = server.dsn


def test_concurrent_start_from_threads(make_server: Factory) -> None:
    first = make_server()
    second = make_server(data_dir=first.data_dir)
    results: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(server: EmbeddedPostgres) -> None:
        try:
            barrier.wait()
            results.append(server.start())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert len(results) == 2 and results[0] == results[1]
    with psycopg.connect(results[0]) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_concurrent_start_from_processes(make_server: Factory) -> None:
    server = make_server()  # registered for teardown; the children start it
    code = (
        "import sys; from pathlib import Path;"
        "from worker.dev.embedded import EmbeddedPostgres;"
        "print(EmbeddedPostgres(Path(sys.argv[1]), durable=False).start())"
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(server.data_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    for child, (_out, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
    dsns = {out.strip() for out, _err in outputs}
    assert len(dsns) == 1
    assert server.is_running()
    assert dsns == {server.dsn}


def test_empty_pg_bin_override_is_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("WORKER_PG_BIN", str(empty))
    with pytest.raises(EmbeddedError) as caught:
        EmbeddedPostgres(tmp_path / "pgdata").start()
    message = str(caught.value)
    assert "\n" not in message
    assert "WORKER_PG_BIN" in message
    assert not (tmp_path / "pgdata" / "PG_VERSION").exists()


def test_no_binaries_anywhere_is_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hide every source of binaries (not the database: nothing gets started here).
    monkeypatch.delenv("WORKER_PG_BIN", raising=False)
    monkeypatch.setattr(pginstall, "_pgserver_install", lambda: None)
    monkeypatch.setattr(pginstall.glob, "glob", lambda pattern: [])
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EmbeddedError) as caught:
        EmbeddedPostgres(tmp_path / "pgdata").start()
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, EmbeddedUnavailable)
    assert "pip install 'worker-pg[embedded]'" in message and "WORKER_DSN" in message


def test_pgserver_binaries_are_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKER_PG_BIN", raising=False)
    assert find_pg_bin().parts[-3:] == ("pgserver", "pginstall", "bin")
    # Locating them must not import pgserver (it registers atexit hooks and runtime dirs).
    code = (
        "import sys; from worker.dev.embedded import find_pg_bin; find_pg_bin();"
        "print('pgserver' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "WORKER_PG_BIN"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "False"


def test_start_failure_reports_cause_and_log(make_server: Factory) -> None:
    server = make_server()
    server.start()
    server.stop()
    with (server.data_dir / "postgresql.conf").open("a") as conf:
        conf.write("\nthis_is_not_a_setting = 1\n")
    with pytest.raises(EmbeddedError) as caught:
        server.start()
    message = str(caught.value)
    assert "\n" not in message
    assert str(server.log_path) in message
    assert "postgresql.conf" in message
    assert "this_is_not_a_setting" in caught.value.detail  # the log tail
    assert not server.is_running()


def _alive(pid: int) -> bool:
    """Running and not a zombie (this container's PID 1 may never reap them)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2] not in "ZX"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs procfs")
def test_start_after_postmaster_was_killed(make_server: Factory) -> None:
    server = make_server(durable=True)
    dsn = server.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table survivor (v int)")
        conn.execute("insert into survivor values (42)")
    pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    children = [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and _ppid(entry) == pid
    ]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in [pid, *children]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.is_running()  # even if the postmaster lingers as a zombie

    assert server.start() == dsn  # stale postmaster.pid cleared, crash recovery ran
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select v from survivor").fetchall() == [(42,)]


def _ppid(proc: Path) -> int | None:
    try:
        text = (proc / "stat").read_text()
    except OSError:
        return None
    return int(text[text.rfind(")") + 2 :].split()[1])


def test_non_cluster_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "pgdata"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(EmbeddedError, match="not empty"):
        EmbeddedPostgres(folder).start()
    assert (folder / "notes.txt").read_text() == "mine"


def test_long_path_uses_short_socket_dir(make_server: Factory, tmp_path_factory) -> None:
    deep = tmp_path_factory.mktemp("embedded-long") / ("d" * 60) / ("e" * 40) / "pgdata"
    server = make_server(data_dir=deep)
    assert server.socket_dir != server.data_dir
    assert len(str(server.socket_dir)) < 80
    with psycopg.connect(server.start()) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="root only")
def test_root_runs_server_as_unprivileged_user(shared_server: EmbeddedPostgres) -> None:
    import pwd

    owner = pwd.getpwuid(shared_server.data_dir.stat().st_uid).pw_name
    expected = os.environ.get("WORKER_EMBEDDED_USER") or "worker-pg"
    assert owner == expected
    with psycopg.connect(shared_server.dsn) as conn:
        pid = conn.execute("select pg_backend_pid()").fetchone()[0]
        # Checked while the connection is open: its backend exits when it closes.
        assert os.stat(f"/proc/{pid}").st_uid == pwd.getpwnam(expected).pw_uid
    # Traversal was granted without making anything world-writable.
    for parent in shared_server.data_dir.parents:
        assert not parent.stat().st_mode & 0o002 or parent.stat().st_mode & 0o1000


def test_ensure_embedded(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("embedded-ensure") / "pgdata"
    try:
        dsn = ensure_embedded(folder)
        assert ensure_embedded(folder) == dsn
        with psycopg.connect(dsn) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
    finally:
        EmbeddedPostgres(folder).stop()


_CREATE_USER = """
import sys, time
from worker.dev.embedded import install as pginstall
start = float(sys.argv[2])
while time.time() < start:
    pass
entry = pginstall._create_user(sys.argv[1])
print(entry.pw_uid, entry.pw_gid)
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="creates a user")
def test_concurrent_user_creation_agrees_on_one_user() -> None:
    """Root hands the embedded server to a system user it creates. Two test processes starting
    together on a new machine both created it, and the second useradd rewrote the user with
    other ids after the first had handed its data folder to the first ones (initdb then failed
    with 'could not look up effective user ID'). Every process must see the same user."""
    import pwd

    name = f"wtest{os.getpid() % 100000}"
    start = time.time() + 1.5
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _CREATE_USER, name, str(start)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        seen = set()
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            seen.add(tuple(int(x) for x in out.split()))
        final = pwd.getpwnam(name)
        assert seen == {(final.pw_uid, final.pw_gid)}
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="creates a user")
def test_user_creation_without_its_lock_file_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the lock that orders user creation cannot be made, root gets one line saying what
    to do instead, not a traceback, and no user is created half-way."""
    import pwd

    monkeypatch.setattr(pginstall.tempfile, "gettempdir", lambda: "/etc/hostname")  # a file
    name = f"wtestlock{os.getpid() % 100000}"
    with pytest.raises(pginstall.EmbeddedError) as caught:
        pginstall._create_user(name)
    message = str(caught.value)
    assert "\n" not in message and "WORKER_EMBEDDED_USER" in message and "lock file" in message
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
