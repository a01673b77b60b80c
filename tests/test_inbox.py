"""The main loop hears NOTIFY on its own claim connection (``engine.inbox``): no listener thread,
one connection fewer per process. What could go wrong with that, tried: the connection is cut while
the loop sleeps on it, the server restarts under an idle worker, reports from other threads race the
loop going to sleep. Each test uses a poll interval of a minute, so only a notification can
explain a task that starts within seconds."""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import random
import resource
import sys
import threading
import time

import psutil
import psycopg
import pytest
from conftest import wait_until
from test_pool import spawned, worker_env

import worker
from worker.dev.embedded import EmbeddedPostgres
from worker.engine.inbox import Inbox

SLOW_POLL = 60.0


def _claim_backend(tw) -> int:
    conn = tw.worker.conn.current
    assert conn is not None and not conn.closed
    return conn.info.backend_pid


def test_an_idle_worker_hears_again_each_time_its_connection_is_cut(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """pg_terminate_backend on the worker's claim connection while it sleeps on it, three times.
    Each time a task is inserted by SQL at once, before the worker can have listened again, and
    another once it has: both start within seconds, though the worker polls once a minute."""
    ran: list[int] = []
    reg = worker.Registry()
    reg.task("ping")(lambda p: ran.append(p["n"]))
    with thread_worker(reg, poll_interval=SLOW_POLL) as tw:
        wait_until(lambda: tw.worker.listening, timeout=10)
        time.sleep(0.5)  # asleep on the socket
        for round_ in range(3):
            old = _claim_backend(tw)
            assert conn.execute("SELECT pg_terminate_backend(%s)", (old,)).fetchone()[0]
            conn.execute(
                f"INSERT INTO {schema}.tasks (task, payload) VALUES ('ping', %s)",
                (psycopg.types.json.Jsonb({"n": 2 * round_}),),
            )
            wait_until(lambda r=round_: 2 * r in ran, timeout=10)
            wait_until(lambda o=old: tw.worker.listening and _claim_backend(tw) != o, timeout=10)
            time.sleep(0.3)
            conn.execute(
                f"INSERT INTO {schema}.tasks (task, payload) VALUES ('ping', %s)",
                (psycopg.types.json.Jsonb({"n": 2 * round_ + 1}),),
            )
            wait_until(lambda r=round_: 2 * r + 1 in ran, timeout=10)
    assert sorted(ran) == list(range(6))


def _count_done(dsn: str, schema: str) -> int | None:
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as c:
            sql = f"SELECT count(*) FROM {schema}.tasks WHERE state = 'done'"
            return c.execute(sql).fetchone()[0]
    except psycopg.Error:
        return None


def test_an_idle_worker_process_hears_again_after_the_database_restarts(
    private_server: EmbeddedPostgres,
) -> None:
    """A real `worker run` idles (polling once a minute) while its server is stopped for two
    seconds and started again. A task inserted by SQL afterwards starts within seconds."""
    dsn = private_server.start()
    schema = "inbox"
    with psycopg.connect(dsn, autocommit=True) as c:
        worker.migrate(c, schema)
    args = ["run", "tasks_module", "--schema", schema, "--processes", "1"]
    args += ["--poll-interval", str(SLOW_POLL)]
    with spawned(*args, env=worker_env(dsn, schema)) as proc:
        with psycopg.connect(dsn, autocommit=True) as c:
            wait_until(
                lambda: c.execute(f"SELECT count(*) FROM {schema}.workers").fetchone()[0] == 1,
                timeout=30,
            )
            c.execute(f"INSERT INTO {schema}.tasks (task) VALUES ('noop')")
            wait_until(lambda: _count_done(dsn, schema) == 1, timeout=10)
        private_server.stop()
        time.sleep(2)
        assert private_server.start() == dsn
        time.sleep(3)  # the worker reconnects (its loop retries within a second) and listens
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f"INSERT INTO {schema}.tasks (task) VALUES ('noop')")
        wait_until(lambda: _count_done(dsn, schema) == 2, timeout=10)
        assert proc.poll() is None


def test_a_worker_process_holds_three_connections(pg_dsn: str, schema: str) -> None:
    """What the README says a worker process costs the server: the main thread's connection
    (claims, acknowledgements, LISTEN), the lease keeper's and maintenance's (transactional
    handlers, none here, borrow from a pool). Counted from the server's side, by the process's
    sockets."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        worker.migrate(c, schema)
        args = ["run", "tasks_module", "--schema", schema, "--processes", "1"]
        with spawned(*args, env=worker_env(pg_dsn, schema)) as proc:
            wait_until(
                lambda: c.execute(f"SELECT count(*) FROM {schema}.workers").fetchone()[0] == 1,
                timeout=30,
            )
            c.execute(f"INSERT INTO {schema}.tasks (task) VALUES ('noop')")
            wait_until(lambda: _count_done(pg_dsn, schema) == 1, timeout=10)
            time.sleep(1.0)
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            ports = set()
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    ports |= {k.laddr.port for k in p.net_connections("tcp") if k.raddr}
            assert ports, "the worker holds no TCP connection: is the test DSN a socket?"
            rows = c.execute(
                "SELECT application_name FROM pg_stat_activity WHERE client_port = ANY(%s)",
                (sorted(ports),),
            ).fetchall()
    assert sorted(r[0] for r in rows) == ["worker", "worker-lease", "worker-maintenance"]


def test_reports_racing_the_loop_to_sleep_are_never_missed(pg_dsn: str) -> None:
    """Another thread puts reports in pairs, the second after a random pause so that it lands
    anywhere on the loop's way back to sleep, and waits for both to be taken before the next
    pair; 3,000 pairs, while the loop sleeps on a listening connection with a long timeout. A
    wake-up lost between the loop's last look at the queue and its sleep would leave the second
    report waiting for the timeout, and the pair would not be taken in time."""
    inbox = Inbox()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        inbox.listen(conn, {"inbox_race": lambda p: None})
        assert inbox.listening
        taken = threading.Semaphore(0)
        stalls: list[int] = []

        def producer() -> None:
            pauses = random.Random(7)
            for i in range(0, 6000, 2):
                inbox.put(i)
                spin = time.perf_counter() + pauses.uniform(0, 60e-6)
                while time.perf_counter() < spin:
                    pass
                inbox.put(i + 1)
                if not (taken.acquire(timeout=5) and taken.acquire(timeout=5)):
                    stalls.append(i)
                    return

        t = threading.Thread(target=producer)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads change hands between almost any two bytecodes
        try:
            t.start()
            got: list[int] = []
            while len(got) < 6000 and not stalls:
                with contextlib.suppress(queue_mod.Empty):
                    got.append(inbox.get(timeout=20))
                    taken.release()
            t.join(10)
        finally:
            sys.setswitchinterval(switch)
    inbox.close()
    assert not stalls and got == list(range(6000))
    inbox.put("after close")  # a runner finishing after the loop stopped: no error


class _PutAfterFirstLook:
    """The inbox's queue, except that its first empty look lets another thread put a report
    right then, before the loop has said it is going to sleep: the worst moment for a put."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self.real: queue_mod.SimpleQueue[object] = inbox._q
        self.looks = 0

    def put(self, item: object) -> None:
        self.real.put(item)

    def get(self, timeout: float | None = None) -> object:
        return self.real.get(timeout=timeout)

    def get_nowait(self) -> object:
        try:
            return self.real.get_nowait()
        except queue_mod.Empty:
            self.looks += 1
            if self.looks == 1:
                t = threading.Thread(target=self.inbox.put, args=("late",))
                t.start()
                t.join()
            raise


def test_a_report_put_just_before_the_loop_sleeps_wakes_it(pg_dsn: str) -> None:
    """The interleaving the stress test above hunts for, forced: a report put after the loop's
    first look found the queue empty and before it sleeps is taken at once, not after the wait's
    timeout."""
    inbox = Inbox()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        inbox.listen(conn, {"inbox_late": lambda p: None})
        inbox._q = _PutAfterFirstLook(inbox)  # type: ignore[assignment]
        t0 = time.monotonic()
        assert inbox.get(timeout=10) == "late"
        assert time.monotonic() - t0 < 5
    inbox.close()


def test_notifications_reach_their_callbacks_from_sleep_and_from_statements(pg_dsn: str) -> None:
    """A notification that arrives while the loop sleeps, and one that arrives while the loop
    runs a statement on the same connection (psycopg reads it with the results), both reach the
    channel's callback, with their payloads, and wake the loop."""
    inbox = Inbox()
    heard: list[str | None] = []

    def on_note(payload: str | None) -> None:
        heard.append(payload)
        inbox.put(("note", payload))

    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        psycopg.connect(pg_dsn, autocommit=True) as other,
    ):
        inbox.listen(conn, {"inbox_notes": on_note})
        assert heard == [None]  # listening: whatever came before may have been missed
        assert inbox.get(timeout=1) == ("note", None)
        threading.Timer(0.3, lambda: other.execute("NOTIFY inbox_notes, 'asleep'")).start()
        t0 = time.monotonic()
        assert inbox.get(timeout=10) == ("note", "asleep")
        assert time.monotonic() - t0 < 5
        other.execute("NOTIFY inbox_notes, 'busy'")
        time.sleep(0.2)
        conn.execute("SELECT 1").fetchone()  # the notification comes in with this result
        assert inbox.get(timeout=10) == ("note", "busy")
    inbox.close()
    assert heard == [None, "asleep", "busy"]


def test_a_cut_connection_is_reported_once_and_never_raises_into_the_loop(pg_dsn: str) -> None:
    """The server ends the listening connection while the loop sleeps on it: the loop's waits
    go on without an exception (an exception there would end the worker's loop), the inbox
    stops claiming to listen, and says it lost the connection exactly once."""
    inbox = Inbox()
    lost: list[int] = []
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        psycopg.connect(pg_dsn, autocommit=True) as other,
    ):
        inbox.listen(conn, {"inbox_cut": lambda p: None}, on_lost=lambda: lost.append(1))
        pid = conn.info.backend_pid
        cut = "SELECT pg_terminate_backend(%s)"
        threading.Timer(0.3, lambda: other.execute(cut, (pid,))).start()
        deadline = time.monotonic() + 10
        while inbox.listening and time.monotonic() < deadline:
            with contextlib.suppress(queue_mod.Empty):
                inbox.get(timeout=1)
        assert not inbox.listening
        for _ in range(3):
            with contextlib.suppress(queue_mod.Empty):
                inbox.get(timeout=0.05)
    inbox.close()
    assert lost == [1]


def test_inboxes_leave_no_open_files_behind(pg_dsn: str) -> None:
    """A Worker that is built and never run (tests, a framework's checks) opens no file; one
    that listened and stopped closes what it opened."""
    fds = len(os.listdir("/proc/self/fd"))
    unused = [Inbox() for _ in range(50)]
    assert len(os.listdir("/proc/self/fd")) == fds
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        used = Inbox()
        used.listen(conn, {"inbox_fds": lambda p: None})
        assert len(os.listdir("/proc/self/fd")) == fds + 3  # the connection and the pipe's ends
        used.close()
        assert len(os.listdir("/proc/self/fd")) == fds + 1
    assert len(os.listdir("/proc/self/fd")) == fds
    del unused


def test_a_worker_with_every_slot_taken_listens_again_after_a_cut(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """One slot, running a task that waits to be cancelled; the claim connection is cut. No
    claim is coming to connect again (the slot stays taken), yet the worker listens again within
    seconds, on a new connection, and the cancel sent then reaches the handler."""
    started, saw_cancel = threading.Event(), threading.Event()
    reg = worker.Registry()

    @reg.task("hold")
    def hold(payload: dict, ctx: worker.Context) -> None:
        started.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ctx.cancelled:
            time.sleep(0.01)
        if ctx.cancelled:
            saw_cancel.set()

    task_id = worker.enqueue(conn, "hold", {}, schema=schema)
    with thread_worker(reg, concurrency=1, poll_interval=SLOW_POLL, lease_seconds=300) as tw:
        assert started.wait(10)
        wait_until(lambda: tw.worker.listening, timeout=10)
        old = _claim_backend(tw)
        assert conn.execute("SELECT pg_terminate_backend(%s)", (old,)).fetchone()[0]
        wait_until(lambda: not tw.worker.listening or _claim_backend(tw) != old, timeout=10)
        wait_until(lambda: tw.worker.listening and _claim_backend(tw) != old, timeout=10)
        assert not saw_cancel.is_set()
        worker.cancel(conn, task_id, schema=schema)
        assert saw_cancel.wait(5)


def test_a_busy_wait_sleeps_its_whole_timeout_yet_wakes_for_a_notification(pg_dsn: str) -> None:
    """With every slot taken the loop waits with ``busy``: it must still sleep as long as it
    asked when nothing comes (not wake fifty times a second for as long as long tasks run), and
    still wake at once for a notification (a cancel request)."""
    inbox = Inbox()
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        psycopg.connect(pg_dsn, autocommit=True) as other,
    ):
        inbox.listen(conn, {"inbox_busy": lambda p: inbox.put(("note", p)) if p else None})
        t0 = time.monotonic()
        with pytest.raises(queue_mod.Empty):
            inbox.get(1.0, busy=True)
        assert time.monotonic() - t0 >= 0.9
        threading.Timer(0.3, lambda: other.execute("NOTIFY inbox_busy, 'stop 7'")).start()
        t0 = time.monotonic()
        assert inbox.get(10.0, busy=True) == ("note", "stop 7")
        assert time.monotonic() - t0 < 5
    inbox.close()


def test_a_process_with_thousands_of_open_files_still_listens(pg_dsn: str) -> None:
    """An application hosting a worker may hold well over a thousand files and sockets, so the
    claim connection's socket gets a number above 1023, which ``select`` cannot watch. The inbox
    must keep listening there and wake for a notification."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        if hard != resource.RLIM_INFINITY and hard < 2048:
            pytest.skip(f"this machine allows {hard} open files, not enough to test")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    filler: list[int] = []
    inbox = Inbox()
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        with (
            psycopg.connect(pg_dsn, autocommit=True) as conn,
            psycopg.connect(pg_dsn, autocommit=True) as other,
        ):
            assert conn.pgconn.socket > 1023
            inbox.listen(conn, {"inbox_many": lambda p: inbox.put(("note", p)) if p else None})
            for n in range(3):
                threading.Timer(0.2, lambda n=n: other.execute(f"NOTIFY inbox_many, '{n}'")).start()
                assert inbox.get(10.0) == ("note", str(n))
                assert inbox.listening
        inbox.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
