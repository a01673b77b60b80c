"""The code samples of the README and of every page under docs/ run as written. A ``python``
block marked ``<!-- sample: FILE -->`` is saved under its file name in a folder of its own,
together with the other samples of the same page (samples are keyed by page: two pages may both
have a ``tasks.py``), and run in a child process (so their ``@worker.task`` names stay out of
this process's registry), against a database of their own whose schema is the default
``worker``, as a reader's would be. A ``sh`` block marked ``<!-- commands: NAME -->`` runs as
written too, in a fresh ``bash`` in that folder (the blocks of one name on one page run as one
script, in their order).

Every ``python`` block is a marked sample, except a listing of signatures marked
``<!-- listing -->`` in the reference (``test_every_python_block_is_run``), and every relative
link between the pages leads to a file that exists, and to a heading of it when it names one
(``test_every_relative_link_resolves``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from worker.db.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent
_SAMPLE = re.compile(r"<!-- sample: ([\w.]+) -->\n```python\n(.*?)```", re.DOTALL)
_COMMANDS = re.compile(r"<!-- commands: ([\w ]+) -->\n```sh\n(.*?)```", re.DOTALL)
# A listing of signatures, not a program: allowed in the reference only.
_LISTING = "<!-- listing -->"
# Linked from the README and the manual, written with the code's layout (it may not be here yet).


# The page each tested sample lives on.
FIRST_WORKER = "README.md"
TUTORIAL = "docs/tutorial.md"
RESULTS = "docs/howto/results-and-waiting.md"
TESTING = "docs/howto/testing.md"
TYPED_PAYLOADS = "docs/howto/typed-payloads.md"
FASTAPI = "docs/howto/fastapi.md"
IN_PROCESS = "docs/howto/in-process-worker.md"
DJANGO = "docs/howto/django.md"
CRON_AND_LOCKS = "docs/howto/cron-and-locks.md"
OPENTELEMETRY = "docs/howto/opentelemetry.md"
FLOW_CONTROL = "docs/howto/flow-control.md"
TOOLS = "docs/development.md"
WORKFLOWS = "docs/howto/workflows.md"


def pages() -> list[str]:
    """The README, the changelog, the architecture and every page of the manual, as paths from
    the root."""
    docs = (str(p.relative_to(ROOT)) for p in ROOT.glob("docs/**/*.md"))
    found = ["README.md", "CHANGELOG.md", "ARCHITECTURE.md", *docs]
    return sorted(p for p in found if (ROOT / p).is_file())


def read(page: str) -> str:
    return (ROOT / page).read_text()


def samples(page: str) -> dict[str, str]:
    return dict(_SAMPLE.findall(read(page)))


def test_the_marked_samples_are_found() -> None:
    found = {page: set(samples(page)) for page in pages() if samples(page)}
    assert found == {
        FIRST_WORKER: {"tasks.py"},
        TUTORIAL: {"tasks.py", "signup.py"},
        RESULTS: {"thumbnails.py"},
        TESTING: {"shop.py", "test_shop.py"},
        TYPED_PAYLOADS: {"billing.py", "produce_bills.py"},
        FASTAPI: {"app.py"},
        IN_PROCESS: {"in_app.py"},
        DJANGO: {"site_settings.py", "orders.py"},
        CRON_AND_LOCKS: {"jobs.py", "schedules.py", "crm_sync.py", "books.py"},
        OPENTELEMETRY: {"traced.py"},
        FLOW_CONTROL: {"api_limits.py"},
        WORKFLOWS: {"pipeline.py", "test_pipeline.py"},
    }


def test_a_page_names_each_sample_once() -> None:
    for page in pages():
        names = [name for name, _ in _SAMPLE.findall(read(page))]
        assert len(names) == len(set(names)), page


def test_every_python_block_is_run() -> None:
    """A ```python block without a sample marker would be a promise nothing checks."""
    unmarked = []
    for page in pages():
        text = read(page)
        for match in re.finditer(r"^```python\n", text, re.M):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if before.startswith("<!-- sample: "):
                continue
            if before == _LISTING and page.startswith("docs/reference/"):
                continue
            unmarked.append(f"{page}: {text[match.end() : match.end() + 60]!r}")
    assert not unmarked, "\n".join(unmarked)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_resolves() -> None:
    """Links between the pages (and into the repository: deploy/, tests/) lead somewhere: to a
    file or folder that exists and, for `page.md#part`, to a heading of that page."""
    broken = []
    for page in pages():
        text = re.sub(r"^```.*?^```", "", read(page), flags=re.M | re.S)  # not inside code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            where = (ROOT / page).parent / path if path else ROOT / page
            if not where.exists():
                broken.append(f"{page}: {target}")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.fixture
def database(pg_dsn: str) -> Iterator[str]:
    """A database of its own, migrated into the default schema, dropped afterwards."""
    name = f"readme_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = make_conninfo(pg_dsn, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, "worker")
        yield dsn
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def write_samples(folder: Path, page: str) -> None:
    for name, code in samples(page).items():
        (folder / name).write_text(code)


def run(
    folder: Path, page: str, dsn: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in ``folder``, which holds the samples of ``page``."""
    write_samples(folder, page)
    env = {**os.environ, "DATABASE_URL": dsn, "PYTHONPATH": str(folder), **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_testing_sample_passes(tmp_path: Path, database: str) -> None:
    out = run(
        tmp_path, TESTING, database, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_shop.py"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout
    # Its fixture rolled everything back.
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT count(*) FROM worker.tasks").fetchone() == (0,)


def test_the_typed_payload_sample(tmp_path: Path, database: str) -> None:
    out = run(tmp_path, TYPED_PAYLOADS, database, "produce_bills.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        "task 'bill': payload does not fit Invoice: field 'number': expected int, got str\n"
    )
    drain = textwrap.dedent(
        """
        import os, psycopg, billing
        from worker import testing
        with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
            testing.run_due(conn).check()
        """
    )
    out = run(tmp_path, TYPED_PAYLOADS, database, "-c", drain)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "billing #42 to ada@example.com\nbilling #43 to bob@example.com\n"


def test_the_fastapi_sample(tmp_path: Path, database: str) -> None:
    """A commit enqueues and the embedded worker runs the task; a rollback enqueues nothing; the
    lifespan's end stops the worker cleanly (it unregistered). The page's set-up step made the
    schema."""
    set_up(tmp_path, FASTAPI, database)
    drive = textwrap.dedent(
        """
        import os, time, psycopg
        from fastapi.testclient import TestClient
        import app

        def rows(conn):
            sql = "SELECT payload->>'email', state::text FROM worker.tasks ORDER BY id"
            return conn.execute(sql).fetchall()

        with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
            with TestClient(app.app) as client:
                assert client.post("/signup", params={"email": "ada@example.com"}).json() == {
                    "ok": True
                }
                blocked = client.post("/signup", params={"email": "x@blocked.example"})
                assert blocked.status_code == 400
                assert isinstance(client.post("/ping").json()["id"], int)
                deadline = time.monotonic() + 30
                while any(s != "done" for _, s in rows(conn)) and time.monotonic() < deadline:
                    time.sleep(0.05)
            print(rows(conn))
            sql = "SELECT count(*) FROM worker.workers WHERE stopped_at IS NULL"
            print(conn.execute(sql).fetchone()[0])
        """
    )
    out = run(tmp_path, FASTAPI, database, "-c", drive)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "welcome ada@example.com" in lines
    assert "welcome ping" in lines
    assert lines[-2:] == ["[('ada@example.com', 'done'), ('ping', 'done')]", "0"]


# The manage.py of `django-admin startproject`, for the settings of the Django page.
MANAGE_PY = """\
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "site_settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""


def test_the_django_sample(tmp_path: Path, database: str) -> None:
    """An order placed commits its task, a blocked one rolls it back; `manage.py worker_run`
    (here `python -m django worker_run`, the same command without a manage.py) runs it, and
    get_result() reads its return value. The page's set-up step (`manage.py migrate`, in the
    project the page's settings make) made the schema."""
    write_samples(tmp_path, DJANGO)
    (tmp_path / "manage.py").write_text(MANAGE_PY)
    set_up(tmp_path, DJANGO, database, says="Applying worker_django.0001_tasks... OK")
    env = {"DJANGO_SETTINGS_MODULE": "site_settings"}
    place = textwrap.dedent(
        """
        import django
        django.setup()
        import orders
        print(orders.place_order(7, "ada@example.com"))
        try:
            orders.place_order(8, "eve@blocked.example")
        except ValueError as exc:
            print("refused:", exc)
        """
    )
    out = run(tmp_path, DJANGO, database, "-c", place, env=env)
    assert out.returncode == 0, out.stderr
    first, refused = out.stdout.splitlines()
    assert refused == "refused: blocked"
    out = run(tmp_path, DJANGO, database, "-m", "django", "worker_run", "--burst", env=env)
    assert out.returncode == 0, out.stderr
    assert "receipt for order 7 to ada@example.com" in out.stdout
    read = "import django; django.setup(); import orders\n" + (
        f"r = orders.send_receipt.get_result({first!r}); print(r.status, r.return_value)"
    )
    out = run(tmp_path, DJANGO, database, "-c", read, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "SUCCESSFUL {'sent_to': 'ada@example.com'}\n"
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT task, payload FROM worker.tasks").fetchall()
    assert rows == [("orders.send_receipt", {"args": [7, "ada@example.com"], "kwargs": {}})]


def test_the_in_process_sample(tmp_path: Path, database: str) -> None:
    """Before the page's set-up step the sample stops at its start with the page's one line (the
    worker never ran); after it, the task runs."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA worker CASCADE")
    out = run(tmp_path, IN_PROCESS, database, "in_app.py")
    assert out.returncode == 1
    line = out.stderr.strip().splitlines()[-1]
    assert line == (
        "worker.errors.SchemaMissing: schema 'worker' has no worker tables in this database: "
        "run `worker migrate`"
    )
    assert f"```text\n{line}\n```" in read(IN_PROCESS)
    assert "hello" not in out.stdout
    set_up(tmp_path, IN_PROCESS, database)
    out = run(tmp_path, IN_PROCESS, database, "in_app.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello ada\n"


def test_every_integration_page_starts_with_its_set_up_step() -> None:
    """Its first section, before anything else, holds the commands that make the schema."""
    for page in (FASTAPI, DJANGO, IN_PROCESS):
        first = read(page).split("\n## ", 2)[1]
        assert first.startswith("First: create the queue's tables\n"), page
        assert "<!-- commands: setup -->" in first, page


def commands(page: str, name: str) -> str:
    """The blocks of commands called ``name`` on ``page``, in their order, as one script."""
    blocks = [code for found, code in _COMMANDS.findall(read(page)) if found == name]
    assert blocks, f"{page} has no commands called {name!r}"
    return "".join(blocks)


def fake_venv(folder: Path) -> None:
    """``.venv/bin/worker`` and ``.venv/bin/python`` in the reader's folder: this interpreter and
    its `worker`, as the README's `pip install` into a venv would have made them."""
    bin_dir = folder / ".venv" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    python = shlex.quote(sys.executable)
    for name, command in (("worker", f"{python} -m worker"), ("python", python)):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (bin_dir / name).chmod(0o755)


def reader_env(folder: Path, dsn: str) -> dict[str, str]:
    """A reader's shell after `source .venv/bin/activate`, with their database in DATABASE_URL
    (and none of this suite's variables)."""
    fake_venv(folder)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORKER_DSN", "WORKER_SCHEMA", "PYTHONPATH")
    }
    path = f"{folder / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "DATABASE_URL": dsn, "PATH": path}


def set_up(
    folder: Path, page: str, dsn: str, *, says: str = "migration(s) to schema worker"
) -> None:
    """The set-up step an integration page starts with, run as written on a database that has
    no queue schema yet; its output ``says`` it made the schema."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS worker CASCADE")
    out = subprocess.run(
        ["bash", "-e", "-c", commands(page, "setup")],
        cwd=folder,
        env=reader_env(folder, dsn),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert says in out.stdout


def test_the_first_worker_commands_run_as_written(tmp_path: Path, database: str) -> None:
    """tasks.py and the shell block after it, in a fresh bash: the schema is there, the worker
    started in the background runs the task (its handler calls the sample's smtp_send), and
    `kill %1`'s signal stops it cleanly."""
    write_samples(tmp_path, FIRST_WORKER)
    fake_venv(tmp_path)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA worker CASCADE")  # a reader's database has none yet
    log = tmp_path / "shell.log"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORKER_DSN", "WORKER_SCHEMA", "PYTHONPATH")
    }
    with log.open("w") as out:
        shell = subprocess.Popen(
            ["bash", "-e", "-c", commands(FIRST_WORKER, "first worker")],
            cwd=tmp_path,
            env={**env, "DATABASE_URL": database},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its background worker is in this process group
        )
    try:
        assert shell.wait(timeout=60) == 0, log.read_text()
        with psycopg.connect(database, autocommit=True) as conn:
            # In "mail", its handler's queue, every time: `worker migrate --module tasks`
            # recorded the route before the worker in the background had started.
            sql = "SELECT queue, state::text FROM worker.tasks WHERE task = 'send_email'"
            deadline = time.monotonic() + 30
            while conn.execute(sql).fetchall() != [("mail", "done")]:
                assert time.monotonic() < deadline, conn.execute(sql).fetchall()
                time.sleep(0.05)
    finally:
        os.killpg(shell.pid, signal.SIGTERM)  # what `kill %1` sends
    with psycopg.connect(database, autocommit=True) as conn:
        sql = "SELECT count(*) FROM worker.workers WHERE stopped_at IS NULL"
        deadline = time.monotonic() + 30
        while conn.execute(sql).fetchone()[0]:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    text = log.read_text()
    assert "applied" in text and "migration(s) to schema worker" in text
    assert "mail to a@b.c: Welcome!" in text
    assert re.search(r"^\d+$", text, re.M)  # the id `worker enqueue` printed
    assert re.search(r"^queue\s+scheduled\s+queued", text, re.M)  # `worker status`
    assert "Traceback" not in text
    assert "warning" not in text  # the task was known: no typo warning


def test_the_tutorial_runs_as_written(tmp_path: Path, database: str) -> None:
    """The tutorial's samples and its commands, one script in a fresh bash with the venv
    activated: migrate, a worker in the background, enqueues from the shell and from Python,
    status, a retry, a failure for good, a result, and `kill %1`'s graceful stop."""
    write_samples(tmp_path, TUTORIAL)
    env = reader_env(tmp_path, database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA worker CASCADE")  # a reader's database has none yet
    log = tmp_path / "shell.log"
    with log.open("w") as out:
        shell = subprocess.Popen(
            ["bash", "-e", "-c", commands(TUTORIAL, "tutorial")],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its background worker is in this process group
        )
    try:
        assert shell.wait(timeout=180) == 0, log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)  # only if the script failed half-way
    text = log.read_text()
    assert "applied" in text and "migration(s) to schema worker" in text
    for to in ("ada", "bob", "eve"):
        assert f"mail to {to}@example.com: Welcome!" in text, text
    assert re.search(r"^enqueued task \d+$", text, re.M)
    assert re.search(r"^queue\s+scheduled\s+queued", text, re.M)  # `worker status`
    assert "ConnectionError: mail server busy" in text  # the retried attempt's error
    assert "worker wait exited with 1" in text
    assert '{"words": 6}' in text.splitlines()
    assert "Traceback" not in text
    with psycopg.connect(database) as conn:
        sql = "SELECT count(*) FROM worker.workers WHERE stopped_at IS NULL"
        assert conn.execute(sql).fetchone() == (0,)  # `kill %1` and `wait` stopped it cleanly
        sql = "SELECT state::text, count(*) FROM worker.tasks GROUP BY 1 ORDER BY 1"
        assert conn.execute(sql).fetchall() == [("done", 4), ("failed", 1)]


def spawn_worker(folder: Path, dsn: str, module: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "worker", "run", module, "--processes", "1"],
        cwd=folder,
        env={**os.environ, "DATABASE_URL": dsn, "PYTHONPATH": str(folder)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_results_sample(tmp_path: Path, database: str) -> None:
    """`worker run thumbnails`, then `python thumbnails.py`: wait and the Waiter get the
    handlers' return values."""
    run(tmp_path, RESULTS, database, "-c", "pass")  # writes the samples
    pool = spawn_worker(tmp_path, database, "thumbnails")
    try:
        out = run(tmp_path, RESULTS, database, "thumbnails.py")
    finally:
        pool.send_signal(signal.SIGTERM)
        pool.communicate(timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "{'url': 'https://cdn.example/cat.jpg', 'size': [128, 128]}",
        "['https://cdn.example/a.jpg', 'https://cdn.example/b.jpg', 'https://cdn.example/c.jpg']",
    ]


def test_the_workflows_sample(tmp_path: Path, database: str) -> None:
    """`worker run pipeline`, then `python pipeline.py`: a chain, a chord and a graph with a
    failure policy run as the page says; its test of them passes without a database."""
    run(tmp_path, WORKFLOWS, database, "-c", "pass")  # writes the samples
    pool = spawn_worker(tmp_path, database, "pipeline")
    try:
        out = run(tmp_path, WORKFLOWS, database, "pipeline.py")
    finally:
        pool.send_signal(signal.SIGTERM)
        pool.communicate(timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "{'title': 'chain', 'inputs': [38]}",
        "{'title': 'chord', 'inputs': [17, 18, 19]}",
        "[('broken', 'failed'), ('report', 'cancelled'), ('always', 'done')]",
    ]
    tested = run(
        tmp_path,
        WORKFLOWS,
        "postgresql://nowhere.invalid/x",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "test_pipeline.py",
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "2 passed" in tested.stdout


def test_the_cron_and_locks_sample(tmp_path: Path, database: str) -> None:
    out = run(tmp_path, CRON_AND_LOCKS, database, "jobs.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "synced users\nsynced orders\n"
    # The schedule is declared: `worker cron jobs` lists it with its next run.
    out = run(tmp_path, CRON_AND_LOCKS, database, "-m", "worker", "cron", "jobs")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^cleanup\s+\*/5 \* \* \* \*\s+UTC\s+cleanup\s+maintenance", out.stdout, re.M)


def test_the_schedules_sample(tmp_path: Path, database: str) -> None:
    """`worker cron schedules` lists the three ways of declaring a schedule."""
    out = run(tmp_path, CRON_AND_LOCKS, database, "-m", "worker", "cron", "schedules")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]}
    assert rows["cleanup"][:6] == ["*/5", "*", "*", "*", "*", "UTC"], out.stdout
    assert rows["nightly_report"][5:7] == ["Europe/Paris", "reports.nightly"], out.stdout
    assert rows["digest"][5:9] == ["UTC", "email.digest", "default", "skip"], out.stdout


def test_the_exclusive_jobs_sample(tmp_path: Path, database: str) -> None:
    """Each job wins its lock once; a second holder of the first lock, before it expired, skips."""
    out = run(tmp_path, CRON_AND_LOCKS, database, "crm_sync.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "crm: synced ada, bob",
        "crm: synced eve",
        "erp: synced ada, bob",
        "erp: synced eve",
        "sync-crm runs elsewhere",
    ]


def test_the_advisory_lock_and_transactional_sample(tmp_path: Path, database: str) -> None:
    """The advisory lock's writes commit with its release; the transactional handler's insert
    commits with its task's completion."""
    out = run(tmp_path, CRON_AND_LOCKS, database, "books.py")
    assert out.returncode == 0, out.stderr
    args = ("-m", "worker", "run", "books", "--burst", "--processes", "1")
    out = run(tmp_path, CRON_AND_LOCKS, database, *args)
    assert out.returncode == 0, out.stderr
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT closed FROM ledger").fetchall() == [(True,)]
        assert conn.execute("SELECT event FROM outbox").fetchall() == [("books.closed",)]
        assert conn.execute("SELECT number FROM invoices").fetchall() == [(42,)]
        sql = "SELECT state::text FROM worker.tasks WHERE task = 'post_invoice'"
        assert conn.execute(sql).fetchall() == [("done",)]


def test_the_optional_tools_table_names_every_tool_the_tests_look_for() -> None:
    """The README's table of tools (chromium, promtool, pgbouncer, ...) and the tests' skips
    agree: each file a row names looks for that tool, and each tool a test looks for on the
    PATH has a row naming that file."""
    text = read(TOOLS)
    rows = re.findall(r"^\| (\w[\w-]*) \| `[^`|]+`[^|]* \| (.*) \|$", text, re.M)
    table = {tool: set(re.findall(r"`(tests/test_\w+\.py)`", where)) for tool, where in rows}
    assert {"chromium", "promtool", "pgbouncer"} <= set(table)
    looked_for: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for tool in re.findall(r'shutil\.which\("([\w-]+)"\)', path.read_text()):
            tool = tool.removesuffix("-browser")
            looked_for.setdefault(tool, set()).add(f"tests/{path.name}")
    # A module that imports another's check (PGBOUNCER from test_pgbouncer) looks for it too.
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for module, names in re.findall(
            r"^from (test_\w+) import ([^\n]+)", path.read_text(), re.M
        ):
            for tool, files in looked_for.items():
                if f"tests/{module}.py" in files and tool.upper() in names:
                    files.add(f"tests/{path.name}")
    for tool, files in table.items():
        assert files, tool
        assert files <= looked_for.get(tool, set()), (tool, files - looked_for.get(tool, set()))
    for tool, files in looked_for.items():
        assert files <= table.get(tool, set()), f"README's table misses {tool} in {files}"


def printed_spans(stdout: str) -> dict[str, dict]:
    """The spans ConsoleSpanExporter printed (indented JSON objects among other output), by name."""
    spans, pos, decoder = {}, 0, json.JSONDecoder()
    while (start := stdout.find("{\n", pos)) != -1:
        span, pos = decoder.raw_decode(stdout, start)
        spans[span["name"]] = span
    return spans


def test_the_opentelemetry_sample(tmp_path: Path, database: str) -> None:
    """The request's span parents the send span; the worker's process span (another process)
    links to it, and the handler's span is a child of the process span."""
    out = run(tmp_path, OPENTELEMETRY, database, "traced.py")
    assert out.returncode == 0, out.stderr
    produced = printed_spans(out.stdout)
    send, checkout = produced["send default"], produced["checkout"]
    assert send["kind"] == "SpanKind.PRODUCER"
    assert send["parent_id"] == checkout["context"]["span_id"]
    out = run(
        tmp_path,
        OPENTELEMETRY,
        database,
        "-m",
        "worker",
        "run",
        "traced",
        "--otel",
        "--burst",
        "--processes",
        "1",
    )
    assert out.returncode == 0, out.stderr
    assert "shipping order 42" in out.stdout.splitlines()
    consumed = printed_spans(out.stdout)
    process, label = consumed["process default"], consumed["print label"]
    assert process["kind"] == "SpanKind.CONSUMER"
    assert [link["context"]["span_id"] for link in process["links"]] == [send["context"]["span_id"]]
    assert process["links"][0]["context"]["trace_id"] == send["context"]["trace_id"]
    assert label["parent_id"] == process["context"]["span_id"]
    assert process["attributes"]["worker.task.outcome"] == "done"


def test_the_limits_sample(tmp_path: Path, database: str) -> None:
    """The flow-control sample: its producer writes each task's key, and its worker records the
    limits the code declares and runs both tasks."""
    out = run(tmp_path, FLOW_CONTROL, database, "api_limits.py")
    assert out.returncode == 0, out.stderr
    args = ("-m", "worker", "run", "api_limits", "--burst", "--processes", "1")
    out = run(tmp_path, FLOW_CONTROL, database, *args, env={"PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr
    # Both handlers print, from two runner threads: print() writes its text and its newline
    # apart, so the two lines may interleave. Each handler's words are there, in their order.
    assert re.search(r"called for.*acme", out.stdout, re.S), out
    assert re.search(r"synced.*globex", out.stdout, re.S), out
    with psycopg.connect(database) as conn:
        keys = conn.execute(
            "SELECT limit_key, state::text FROM worker.tasks ORDER BY limit_key"
        ).fetchall()
        limits = conn.execute(
            "SELECT queue, concurrency, key_concurrency, key_rate, key_rate_seconds, source"
            " FROM worker.queue_limits ORDER BY queue"
        ).fetchall()
    assert keys == [("acme", "done"), ("globex", "done")]
    assert limits == [("api", None, 2, 10, 1.0, "code"), ("reports", 4, None, None, None, "code")]
