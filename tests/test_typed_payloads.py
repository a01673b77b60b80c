"""Typed payloads: ``@task(payload=Model)`` with a dataclass or a pydantic model. The producer
validates at the call site; the handler gets an instance; a row that does not fit fails for good."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest

import worker
from tests.conftest import wait_until
from worker import testing
from worker.tasks.registry import Registry

pydantic = pytest.importorskip("pydantic")


@dataclasses.dataclass
class Address:
    city: str


@dataclasses.dataclass
class Email:
    to: str
    retries: int = 0
    cc: list[str] | None = None
    address: Address | None = None


class Invoice(pydantic.BaseModel):
    number: int
    total: float


@pytest.fixture
def tx(pg_dsn: str, schema: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_dsn) as conn:
        yield conn
        conn.rollback()


def test_a_dataclass_is_checked_at_enqueue_and_handed_to_the_handler(
    tx: psycopg.Connection, schema: str
) -> None:
    reg = Registry()
    got: list[Email] = []

    @reg.task("send", payload=Email)
    def send(payload: Email) -> None:
        got.append(payload)

    worker.enqueue(tx, send, Email("a@b.c", cc=["d@e.f"]), schema=schema)
    worker.enqueue(tx, send, {"to": "x@y.z", "address": {"city": "Lyon"}}, schema=schema)
    testing.assert_enqueued(tx, send, Email("a@b.c", cc=["d@e.f"]), schema=schema)
    # Stored as plain JSON, with the defaults filled in.
    assert testing.enqueued(tx, send, schema=schema)[0].payload == {
        "to": "a@b.c",
        "retries": 0,
        "cc": ["d@e.f"],
        "address": None,
    }
    testing.run_due(tx, reg, schema=schema).check()
    assert got == [Email("a@b.c", cc=["d@e.f"]), Email("x@y.z", address=Address("Lyon"))]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({}, "task 'send': payload does not fit Email: field 'to': missing"),
        ({"to": 3}, "field 'to': expected str, got int"),
        ({"to": "a", "bcc": "b"}, "field 'bcc': unknown field"),
        ({"to": "a", "retries": True}, "field 'retries': expected int, got bool"),
        ({"to": "a", "address": {"town": "x"}}, "field 'address.town': unknown field"),
        ([1], "task 'send' takes a Email payload (or a dict of its fields), not list"),
    ],
)
def test_a_bad_dataclass_payload_fails_at_the_call_site(
    tx: psycopg.Connection, schema: str, payload: object, message: str
) -> None:
    reg = Registry()
    send = reg.task("send", payload=Email)(lambda p: None)
    with pytest.raises(worker.PayloadError) as failure:
        worker.enqueue(tx, send, payload, schema=schema)
    assert message in str(failure.value)
    assert "\n" not in str(failure.value)
    assert isinstance(failure.value, ValueError)
    assert testing.enqueued(tx, schema=schema) == []


def test_a_pydantic_model(tx: psycopg.Connection, schema: str) -> None:
    reg = Registry()
    got: list[Invoice] = []
    bill = reg.task("bill", payload=Invoice)(got.append)

    worker.enqueue(tx, bill, Invoice(number=7, total=9.5), schema=schema)
    worker.enqueue(tx, bill, {"number": "8", "total": 1}, schema=schema)  # pydantic coerces
    worker.enqueue_many(tx, bill, [Invoice(number=9, total=0)], schema=schema)
    with pytest.raises(worker.PayloadError) as failure:
        worker.enqueue(tx, bill, {"number": "eight"}, schema=schema)
    assert str(failure.value) == (
        "task 'bill': payload does not fit Invoice: field 'number': Input should be a valid "
        "integer, unable to parse string as an integer; field 'total': Field required"
    )
    with pytest.raises(worker.PayloadError, match="does not fit Invoice"):
        worker.enqueue_many(tx, bill, [{"number": "x", "total": 1}], schema=schema)

    testing.run_due(tx, reg, schema=schema).check()
    assert got == [
        Invoice(number=7, total=9.5),
        Invoice(number=8, total=1.0),
        Invoice(number=9, total=0.0),
    ]


def test_a_row_written_by_sql_that_does_not_fit_fails_for_good(
    tx: psycopg.Connection, schema: str
) -> None:
    reg = Registry()
    ran = []
    reg.task("bill", payload=Invoice, max_attempts=5)(ran.append)
    tx.execute(f"INSERT INTO {schema}.tasks (task, payload) VALUES ('bill', '{{\"number\": 1}}')")
    [run] = testing.run_due(tx, reg, schema=schema).failed
    assert ran == []
    assert run.state == "failed"
    [row] = testing.enqueued(tx, "bill", schema=schema)
    assert (row.state, row.attempts) == ("failed", 1)
    assert row.last_error == (
        "PayloadError: task 'bill': payload does not fit Invoice: field 'total': Field required; "
        "not retried"
    )


def test_the_worker_fails_a_bad_row_at_once_and_runs_good_ones(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    reg = Registry()
    got: list[Email] = []
    send = reg.task("send", payload=Email, max_attempts=5)(got.append)
    conn.execute(f"INSERT INTO {schema}.tasks (task, payload) VALUES ('send', '{{\"to\": 5}}')")
    worker.enqueue(conn, send, Email("a@b.c"), schema=schema)
    with thread_worker(reg):
        wait_until(lambda: testing.enqueued(conn, schema=schema)[1].state == "done")
        wait_until(lambda: testing.enqueued(conn, schema=schema)[0].state == "failed")
    bad = testing.enqueued(conn, schema=schema)[0]
    assert bad.attempts == 1
    assert bad.last_error == (
        "PayloadError: task 'send': payload does not fit Email: field 'to': expected str, "
        "got int; not retried"
    )
    assert got == [Email("a@b.c")]


def test_registering_something_else_is_refused() -> None:
    with pytest.raises(TypeError, match="payload= must be a dataclass or a pydantic model"):
        Registry().task("x", payload=dict)


def test_nothing_imports_pydantic() -> None:
    """Without pydantic installed (here: made unimportable), `import worker`, a typed dataclass
    task and an enqueue's payload checks all work, and nothing tries to import it."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pydantic', 'pydantic_core'):\n"
        "            raise ImportError('pydantic is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import dataclasses, worker, worker.testing\n"
        "from worker.tasks.enqueue import _enqueue_params\n"
        "@dataclasses.dataclass\n"
        "class P:\n"
        "    n: int\n"
        "t = worker.task('typed', payload=P)(lambda p: None)\n"
        "print(_enqueue_params(t, P(1), None, None, None, 0, None, None)['payload'].obj)\n"
        "p = _enqueue_params('plain', {'a': 1}, None, None, None, 0, None, None)\n"
        "print(p['payload'].obj)\n"
        "print([m for m in sys.modules if m.startswith('pydantic')])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["{'n': 1}", "{'a': 1}", "[]"]
