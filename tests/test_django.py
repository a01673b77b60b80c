"""The Django Tasks backend (worker.contrib.django) in a real Django project (tests/django_site)
on the test database: Django's @task functions enqueued with .enqueue() run on our workers, the
enqueue joins the caller's transaction.atomic(), results come back through get_result(), and
`manage.py worker_run` runs the worker in a real process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import django
import psycopg
import pytest
from conftest import ROOT, ThreadWorker, wait_until
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connections, transaction
from django.test import override_settings
from psycopg.types.json import Jsonb

from worker import SchemaMissing, TaskCancelled, WorkerConfig, cancel, enqueue
from worker.contrib.django.compat import (
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_finished,
    task_started,
)
from worker.contrib.django.registry import DjangoRegistry
from worker.db.migrate import migrate


def _site_env(dsn: str, schema: str) -> dict[str, str]:
    return {
        "DJANGO_SITE_DSN": dsn,
        "DJANGO_SITE_SCHEMA": schema,
        "DJANGO_SETTINGS_MODULE": "django_site.settings",
    }


@pytest.fixture(scope="module")
def site(pg_dsn: str) -> Iterator[str]:
    """Django set up in this process on a schema of its own (Django is set up once per process,
    so the schema is the module's, not each test's: tests tell their rows apart by id)."""
    schema = f"dj_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        migrate(c, schema)
    os.environ.update(_site_env(pg_dsn, schema))
    django.setup()
    yield schema
    connections.close_all()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
def tasks(site: str) -> Any:
    # Imported once Django is set up: defining a task looks its backend up in the settings.
    import django_site.tasks as module

    return module


@pytest.fixture
def django_worker(pg_dsn: str, site: str) -> Iterator[ThreadWorker]:
    config = WorkerConfig(dsn=pg_dsn, schema=site, queues=["default", "mail"], poll_interval=0.2)
    with ThreadWorker(config, DjangoRegistry()) as tw:
        yield tw


def row(pg_dsn: str, schema: str, task_id: str) -> dict[str, Any] | None:
    """The task's row as another connection sees it (committed data only)."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        cur = c.execute(
            "SELECT task, queue, priority, run_at, payload, state::text, max_attempts, "
            f"attempts, last_error, result FROM {schema}.tasks WHERE id = %s",
            (int(task_id),),
        )
        found = cur.fetchone()
        assert cur.description is not None
        names = [d.name for d in cur.description]
    return None if found is None else dict(zip(names, found, strict=True))


def finished(result: Any) -> Any:
    """Wait (through get_result, as a Django user would) until the task has finished."""

    def done() -> Any:
        result.refresh()
        return result.is_finished

    wait_until(done, timeout=20)
    return result


def test_enqueued_tasks_run_on_our_worker_and_return_results(
    tasks: Any, django_worker: ThreadWorker
) -> None:
    signalled: list[tuple[str, str, str]] = []

    def record(signal: str) -> Any:
        def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
            signalled.append((signal, task_result.id, str(task_result.status)))

        return receiver

    on_started, on_finished = record("started"), record("finished")
    task_started.connect(on_started)
    task_finished.connect(on_finished)
    try:
        added = tasks.add.enqueue(2, 3)
        sent = tasks.send.enqueue("ada@example.com", subject="welcome")
        who = tasks.whoami.enqueue(tag="x")
        shouted = asyncio.run(tasks.shout.aenqueue("hey"))  # an async task, enqueued async
        assert added.status == TaskResultStatus.READY
        for result in (added, sent, who, shouted):
            assert finished(result).status == TaskResultStatus.SUCCESSFUL, result.errors
    finally:
        task_started.disconnect(on_started)
        task_finished.disconnect(on_finished)
    # Django's signals, as its own backends send them, from the worker's threads.
    assert ("started", added.id, "RUNNING") in signalled
    assert ("finished", added.id, "SUCCESSFUL") in signalled
    assert asyncio.run(tasks.shout.aget_result(shouted.id)).return_value == "HEY"
    assert added.return_value == {"sum": 5}
    assert sent.return_value == "sent 'welcome' to ada@example.com"
    # A takes_context task sees its own result id and attempt.
    assert who.return_value == {"id": who.id, "attempt": 1, "tag": "x"}
    # A fresh read, through the task (which checks the row is this task's), says the same.
    again = tasks.add.get_result(added.id)
    assert again.return_value == {"sum": 5}
    assert again.args == [2, 3] and again.kwargs == {}
    assert again.attempts == 1 and again.worker_ids == [django_worker.worker.id]
    assert again.enqueued_at is not None and again.finished_at >= again.started_at
    assert again.errors == []


def test_enqueue_joins_the_callers_transaction(pg_dsn: str, site: str, tasks: Any) -> None:
    with pytest.raises(RuntimeError, match="the view failed"), transaction.atomic():
        doomed = tasks.add.enqueue(1, 1)
        # Inside the transaction the caller sees its row, and nobody else does yet.
        assert tasks.add.get_result(doomed.id).args == [1, 1]
        assert row(pg_dsn, site, doomed.id) is None
        raise RuntimeError("the view failed")
    assert row(pg_dsn, site, doomed.id) is None
    with pytest.raises(TaskResultDoesNotExist):
        tasks.add.get_result(doomed.id)

    with transaction.atomic():
        kept = tasks.add.enqueue(2, 2)
        assert row(pg_dsn, site, kept.id) is None  # not before the commit
    found = row(pg_dsn, site, kept.id)
    assert found is not None and found["state"] == "queued"


def test_priority_run_after_queue_and_arguments_map_to_the_row(
    pg_dsn: str, site: str, tasks: Any
) -> None:
    later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    result = tasks.send.using(priority=-100, run_after=later).enqueue("bob", subject="s")
    found = row(pg_dsn, site, result.id)
    assert found is not None
    assert found["task"] == "django_site.tasks.send"
    assert found["queue"] == "mail"
    assert found["priority"] == -100
    assert found["run_at"] == later
    assert found["state"] == "scheduled"
    assert found["payload"] == {"args": ["bob"], "kwargs": {"subject": "s"}}
    assert found["max_attempts"] == 1  # Django tasks do not retry unless OPTIONS say so
    assert tasks.send.get_result(result.id).status == TaskResultStatus.READY

    # The decorator's own priority and queue, and another backend's MAX_ATTEMPTS.
    plain = row(pg_dsn, site, tasks.send.enqueue("eve").id)
    assert plain is not None and (plain["priority"], plain["queue"]) == (7, "mail")
    flaky = tasks.flaky.enqueue("m")
    found = row(pg_dsn, site, flaky.id)
    assert found is not None and found["max_attempts"] == 3

    # With USE_TZ off, Django's datetimes are naive and mean its TIME_ZONE.
    with override_settings(USE_TZ=False, TIME_ZONE="Europe/Paris"):
        naive = tasks.add.using(run_after=datetime(2030, 1, 1, 12, 0)).enqueue(1, 2)
    found = row(pg_dsn, site, naive.id)
    assert found is not None and found["run_at"] == datetime(2030, 1, 1, 11, 0, tzinfo=UTC)

    with psycopg.connect(pg_dsn, autocommit=True) as c:  # not for the other tests' workers
        c.execute(f"DELETE FROM {site}.tasks")


def test_a_task_that_raises_is_failed_with_its_error(
    tasks: Any, django_worker: ThreadWorker
) -> None:
    result = finished(tasks.explode.enqueue("boom"))
    assert result.status == TaskResultStatus.FAILED
    assert len(result.errors) == 1
    assert result.errors[0].exception_class is ValueError
    assert "ValueError: boom" in result.errors[0].traceback
    assert "in explode" in result.errors[0].traceback  # the worker's traceback frames
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value


def test_errors_are_one_per_failed_attempt_from_the_history(
    pg_dsn: str, site: str, tasks: Any
) -> None:
    """A task retried (MAX_ATTEMPTS) shows one error per failed attempt: the history's entries
    (its cut texts), the last one whole from last_error, and no entry for a hand-back, which was
    no failure of the task. The row is made by SQL, as three real attempts would leave it."""
    result = tasks.flaky.enqueue("m")
    history = [
        {"attempt": 1, "error": "RuntimeError: one"},
        {"attempt": 2, "error": "UnknownTask: no handler named ...", "counted": False},
        {"attempt": 2, "error": "RuntimeError: two"},
        {"attempt": 3, "error": "RuntimeError: th"},
    ]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            f"UPDATE {site}.tasks SET state = 'failed', attempts = 3, finished_at = now(), "
            "started_at = now(), worker_id = gen_random_uuid(), errors = %s, "
            "last_error = 'RuntimeError: three, whole' WHERE id = %s",
            (Jsonb(history), int(result.id)),
        )
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.traceback for e in result.errors] == [
        "RuntimeError: one",
        "RuntimeError: two",
        "RuntimeError: three, whole",
    ]
    assert {e.exception_class for e in result.errors} == {RuntimeError}
    assert result.attempts == 3


def test_a_cancelled_task_reads_failed_with_task_cancelled(
    pg_dsn: str, site: str, tasks: Any
) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    result = tasks.add.using(run_after=later).enqueue(1, 1)
    assert cancel(pg_dsn, int(result.id), schema=site).outcome == "cancelled"
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["worker.TaskCancelled"]
    assert result.errors[0].exception_class is TaskCancelled


def test_a_task_the_worker_cannot_import_waits_and_says_why(
    pg_dsn: str, site: str, django_worker: ThreadWorker
) -> None:
    """A row naming a module this worker lacks (a producer deployed ahead of it) is handed back
    for a worker that has it, never failed, and its row says what is missing. A module outside
    the installed apps is never imported at all (`this` prints on import)."""
    empty = {"args": [], "kwargs": {}}
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        gone = enqueue(c, "django_site.missing.gone", empty, schema=site)
        plain = enqueue(c, "django_site.tasks.not_there", empty, schema=site)
        foreign = enqueue(c, "this.s", empty, schema=site)

    def said(task_id: int, text: str) -> bool:
        found = row(pg_dsn, site, str(task_id))
        return found is not None and text in (found["last_error"] or "")

    wait_until(lambda: said(gone, "cannot import module 'django_site.missing' (ModuleNotFound"))
    wait_until(lambda: said(plain, "'django_site.tasks.not_there' is not a Django task"))
    wait_until(lambda: said(foreign, "module 'this' is in no installed app"))
    assert "this" not in sys.modules
    for task_id in (gone, plain, foreign):
        found = row(pg_dsn, site, str(task_id))
        assert found is not None
        assert found["state"] in ("queued", "scheduled") and found["attempts"] == 0
    with psycopg.connect(pg_dsn, autocommit=True) as c:  # not for the other tests' workers
        c.execute(f"DELETE FROM {site}.tasks")


def test_a_non_postgresql_database_is_refused_clearly(tasks: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"needs a PostgreSQL database; DATABASES\["):
        tasks.on_sqlite.enqueue()
    # Django's system checks say so too (the test settings silence it for the commands below).
    found = [m for m in checks.run_checks() if m.id == "worker.E001"]
    assert [m.msg for m in found] == [
        "TASKS['sqlite'] uses worker.contrib.django.WorkerBackend, which needs a PostgreSQL "
        "database; DATABASES['other'] is sqlite"
    ]


def test_enqueue_on_a_schema_that_is_not_there_says_to_migrate(
    tasks: Any, site: str, pg_dsn: str
) -> None:
    """Not PostgreSQL's error: one line naming Django's command, on the backend's database."""
    line = (
        "schema 'no_such_schema' has no worker tables in this database: "
        "run `python manage.py migrate --database elsewhere`"
    )
    with pytest.raises(SchemaMissing) as info:
        tasks.unmigrated.enqueue()
    assert str(info.value) == line
    with pytest.raises(SchemaMissing) as info, transaction.atomic(using="elsewhere"):
        tasks.unmigrated.enqueue()
    assert str(info.value) == line
    with pytest.raises(SchemaMissing) as info:
        tasks.unmigrated.get_result("1")
    assert str(info.value) == line
    # Django's connection goes on: the failed statement's transaction was rolled back.
    with connections["elsewhere"].cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


def _manage(pg_dsn: str, site: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **_site_env(pg_dsn, site), "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_management_command_runs_the_tasks(pg_dsn: str, site: str, tasks: Any) -> None:
    added = tasks.add.enqueue(20, 22)
    mail = tasks.send.enqueue("zoe")
    out = _manage(pg_dsn, site, "worker_run", "--burst", "--poll-interval", "0.1")
    assert out.returncode == 0, out.stderr
    assert "serving Django tasks of TASKS['default'] from queues default, mail" in out.stderr
    for result in (added, mail):
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    assert added.return_value == {"sum": 42}


def test_the_management_command_refuses_bad_options(site: str) -> None:
    with pytest.raises(CommandError, match="--keep-done must be above 0") as info:
        call_command("worker_run", "--keep-done", "0")
    assert info.value.returncode == 2
    with pytest.raises(CommandError) as info:
        call_command("worker_run", "--backend", "unmigrated")
    assert info.value.returncode == 2
    assert str(info.value) == (
        "schema 'no_such_schema' has no worker tables in this database: "
        "run `python manage.py migrate --database elsewhere`"
    )


def test_a_failing_task_inserted_by_plain_sql_fails_after_its_attempts(
    pg_dsn: str, site: str, tasks: Any, django_worker: ThreadWorker
) -> None:
    """A Django task written by a SQL producer leaves max_attempts to the handler (NULL). The
    worker's registry loads Django tasks on demand, so the claim does not know the handler yet:
    its first failure takes the handler's max_attempts (1, a Django task's) and the row fails
    for good instead of being retried forever."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        row_ = c.execute(
            f"INSERT INTO {site}.tasks (task, payload) VALUES"
            " ('django_site.tasks.explode', %s) RETURNING id",
            (Jsonb({"args": ["by sql"], "kwargs": {}}),),
        ).fetchone()
    assert row_ is not None
    task_id = str(row_[0])
    wait_until(lambda: (row(pg_dsn, site, task_id) or {}).get("state") == "failed", timeout=20)
    time.sleep(1.0)  # a retry, were there one, would be due within this
    got = row(pg_dsn, site, task_id)
    assert got is not None
    assert (got["state"], got["attempts"], got["max_attempts"]) == ("failed", 1, 1)
    assert "ValueError: by sql" in got["last_error"]
