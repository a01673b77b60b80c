"""The OpenTelemetry extra (worker/contrib/otel.py, README "OpenTelemetry"): producer spans stored
with the row, consumer spans linked to them, retries, failures and cancellation on the span, the
handler's spans nested, rows with no (or a hostile) context, a real `worker run --otel` process,
and a process without the extra that never loads OpenTelemetry. Spans are read from the SDK's
in-memory exporter (or, across processes, from the worker's JSON export)."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import textwrap
import uuid
import weakref
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import ROOT, run_cli, states, wait_until
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import worker
from worker.contrib import otel
from worker.db import migrate as _migrate


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(provider)
    yield provider, exporter
    otel.uninstrument()


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def traceparent(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def linked_to(span: ReadableSpan) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


def ids(span: ReadableSpan) -> tuple[int, int]:
    ctx = span.get_span_context()
    return ctx.trace_id, ctx.span_id


def stored_context(conn: psycopg.Connection, schema: str, task_id: int) -> Any:
    return conn.execute(
        f"SELECT trace_context FROM {schema}.tasks WHERE id = %s", (task_id,)
    ).fetchone()[0]


def test_the_consumer_span_links_to_the_producer_and_is_the_handlers_parent(
    traced: Any, conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    provider, exporter = traced
    tracer = provider.get_tracer("app")
    reg = worker.Registry()

    @reg.task("otel.work", queue="otelq")
    def work(payload: dict) -> None:
        with tracer.start_as_current_span("handler work"):
            pass

    with tracer.start_as_current_span("request"):
        task_id = worker.enqueue(conn, work, {"n": 1}, schema=schema)
    producer = one(exporter.get_finished_spans(), "send otelq")
    assert producer.kind is SpanKind.PRODUCER
    assert producer.parent.span_id == ids(one(exporter.get_finished_spans(), "request"))[1]
    assert producer.attributes["messaging.system"] == "worker"
    assert producer.attributes["messaging.operation.type"] == "send"
    assert producer.attributes["messaging.destination.name"] == "otelq"
    assert producer.attributes["messaging.message.id"] == str(task_id)
    # The row carries the producer span's own context, as W3C traceparent.
    assert stored_context(conn, schema, task_id)["traceparent"] == traceparent(producer)

    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 1})
    spans = exporter.get_finished_spans()
    consumer = one(spans, "process otelq")
    assert consumer.kind is SpanKind.CONSUMER
    assert linked_to(consumer) == [ids(producer)]
    assert consumer.attributes["messaging.system"] == "worker"
    assert consumer.attributes["messaging.operation.type"] == "process"
    assert consumer.attributes["messaging.destination.name"] == "otelq"
    assert consumer.attributes["messaging.message.id"] == str(task_id)
    assert consumer.attributes["worker.task.name"] == "otel.work"
    assert consumer.attributes["worker.task.attempt"] == 1
    assert consumer.attributes["worker.task.outcome"] == "done"
    assert consumer.status.status_code is StatusCode.UNSET
    handler = one(spans, "handler work")
    assert handler.parent is not None and handler.parent.span_id == ids(consumer)[1]
    assert ids(handler)[0] == ids(consumer)[0]


def test_a_retry_then_a_failure_are_recorded_on_each_runs_span(
    traced: Any, conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    _, exporter = traced
    reg = worker.Registry()

    @reg.task("otel.flaky", queue="otelq", max_attempts=2, retry_backoff=0)
    def flaky(payload: dict) -> None:
        raise ValueError("boom")

    task_id = worker.enqueue(conn, flaky, schema=schema)
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"failed": 1})
    spans = exporter.get_finished_spans()
    producer = one(spans, "send otelq")
    runs = sorted(
        (s for s in spans if s.name == "process otelq"),
        key=lambda s: s.attributes["worker.task.attempt"],
    )
    assert [s.attributes["worker.task.attempt"] for s in runs] == [1, 2]
    assert [s.attributes["worker.task.outcome"] for s in runs] == ["retry", "failed"]
    for run, fate in zip(runs, ["retry", "failed"], strict=True):
        assert run.attributes["messaging.message.id"] == str(task_id)
        assert linked_to(run) == [ids(producer)]
        assert run.status.status_code is StatusCode.ERROR
        assert run.status.description.startswith("ValueError: boom")
        assert run.attributes["error.type"] == "ValueError"
        events = {e.name: e for e in run.events}
        assert events["exception"].attributes["exception.type"] == "ValueError"
        assert events["exception"].attributes["exception.message"] == "boom"
        assert f"worker.task.{fate}" in events


def test_enqueue_many_is_one_batch_span_that_every_row_links_to(
    traced: Any, conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    provider, exporter = traced
    reg = worker.Registry()
    work = reg.task("otel.bulk", queue="otelq")(lambda payload: None)
    with provider.get_tracer("app").start_as_current_span("import"):
        assert worker.enqueue_many(conn, work, [{"i": i} for i in range(3)], schema=schema) == 3
        # The other COPY statement: rows given a run_at.
        now = datetime.now(UTC)
        assert worker.enqueue_many(conn, work, [{"i": 9}], run_at=now, schema=schema) == 1
    sends = [s for s in exporter.get_finished_spans() if s.name == "send otelq"]
    assert [s.attributes["messaging.batch.message_count"] for s in sends] == [3, 1]
    assert all(s.kind is SpanKind.PRODUCER for s in sends)
    rows = conn.execute(
        f"SELECT payload->>'i', trace_context->>'traceparent' FROM {schema}.tasks ORDER BY id"
    ).fetchall()
    assert rows == [
        ("0", traceparent(sends[0])),
        ("1", traceparent(sends[0])),
        ("2", traceparent(sends[0])),
        ("9", traceparent(sends[1])),
    ]
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 4})
    runs = [s for s in exporter.get_finished_spans() if s.name == "process otelq"]
    assert sorted(linked_to(r)[0] for r in runs) == sorted([ids(sends[0])] * 3 + [ids(sends[1])])


def test_a_workflows_steps_share_the_trace_of_its_enqueue(
    traced: Any, conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """A chain of 3 steps run by a worker: one producer span for the workflow, whose context
    every step stores; each step's run is its child (one trace), carries the workflow's id, and
    is the parent of its handler's own spans. A workflow written by SQL runs with root spans."""
    provider, exporter = traced
    tracer = provider.get_tracer("app")
    reg = worker.Registry()

    @reg.task("otel.step", queue="otelq")
    def step(payload: dict, ctx: worker.Context) -> int:
        with tracer.start_as_current_span(f"handler work {payload['n']}"):
            return int(payload["n"]) + sum(ctx.inputs)

    flow = worker.chain(*(worker.step(step, {"n": n}) for n in (1, 2, 3)))
    with tracer.start_as_current_span("request"):
        wf = worker.enqueue_workflow(conn, flow, schema=schema)
    producer = one(exporter.get_finished_spans(), "send otelq")
    assert producer.kind is SpanKind.PRODUCER
    assert producer.parent.span_id == ids(one(exporter.get_finished_spans(), "request"))[1]
    assert producer.attributes["worker.workflow.id"] == wf.id
    assert producer.attributes["worker.workflow.name"] == ""
    assert producer.attributes["messaging.batch.message_count"] == 3
    steps = [wf[s] for s in flow.steps]
    for task_id in steps:
        assert stored_context(conn, schema, task_id)["traceparent"] == traceparent(producer)

    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 3}, timeout=30)
    spans = exporter.get_finished_spans()
    runs = sorted(
        (s for s in spans if s.name == "process otelq"),
        key=lambda s: int(s.attributes["messaging.message.id"]),
    )
    assert [int(s.attributes["messaging.message.id"]) for s in runs] == steps
    trace_id = ids(producer)[0]
    for n, run in enumerate(runs, start=1):
        assert run.kind is SpanKind.CONSUMER
        assert ids(run)[0] == trace_id  # one trace
        assert run.parent is not None and run.parent.span_id == ids(producer)[1]
        assert run.links == ()  # the parent says it: no link besides
        assert run.attributes["worker.workflow.id"] == wf.id
        assert run.attributes["worker.task.outcome"] == "done"
        handler = one(spans, f"handler work {n}")
        assert handler.parent.span_id == ids(run)[1] and ids(handler)[0] == trace_id

    # Written by SQL, without a context: each step runs as a root span with the workflow's id.
    exporter.clear()
    (sql_id,) = conn.execute(
        f"SELECT {schema}.create_workflow(%s::jsonb, 'by sql')",
        (json.dumps([{"key": "a", "task": "otel.step", "queue": "otelq", "payload": {"n": 1}}]),),
    ).fetchone()
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 4}, timeout=30)
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "process otelq"]
    assert root.parent is None and root.links == ()
    assert root.attributes["worker.workflow.id"] == sql_id


def test_enqueue_async_stores_its_span_context(
    traced: Any, pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    _, exporter = traced

    async def produce() -> int:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as aconn:
            return await worker.enqueue_async(aconn, "otel.any", queue="otelq", schema=schema)

    task_id = asyncio.run(produce())
    producer = one(exporter.get_finished_spans(), "send otelq")
    assert producer.attributes["messaging.message.id"] == str(task_id)
    assert stored_context(conn, schema, task_id)["traceparent"] == traceparent(producer)


def test_rows_without_a_usable_context_run_with_a_root_consumer_span(
    traced: Any, conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """A plain INSERT, the SQL enqueue() and rows whose context is not a trace context (written
    by hand, or hostile) run as usual; their spans are roots with no link."""
    _, exporter = traced
    reg = worker.Registry()
    reg.task("otel.plain", queue="otelq")(lambda payload: None)
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('otel.plain', 'otelq')")
    conn.execute(f"SELECT {schema}.enqueue('otel.plain', queue => 'otelq')")
    hostile = [
        '"a string"',
        "[1, 2]",
        '{"traceparent": 5}',
        '{"traceparent": "00-garbage"}',
        json.dumps({"traceparent": "x" * 10_000}),
        "[" * 2000 + "]" * 2000,  # deeper than json.loads takes
    ]
    for text in hostile:
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, trace_context)"
            " VALUES ('otel.plain', 'otelq', %s::jsonb)",
            (text,),
        )
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 2 + len(hostile)})
    runs = [s for s in exporter.get_finished_spans() if s.name == "process otelq"]
    assert len(runs) == 2 + len(hostile)
    for run in runs:
        assert run.links == () or list(run.links) == []
        assert run.parent is None
        assert run.attributes["worker.task.outcome"] == "done"


def test_a_cancelled_run_says_so_on_its_span(
    traced: Any, conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    _, exporter = traced
    reg = worker.Registry()

    @reg.task("otel.slow", queue="otelq")
    async def slow(payload: dict) -> None:
        await asyncio.sleep(30)

    task_id = worker.enqueue(conn, slow, schema=schema)
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"in_progress": 1})
        worker.cancel(conn, task_id, schema=schema)
        wait_until(lambda: states(conn, schema) == {"cancelled": 1})
    run = one(exporter.get_finished_spans(), "process otelq")
    assert run.attributes["worker.task.outcome"] == "cancelled"
    assert run.status.status_code is StatusCode.ERROR
    assert "worker.task.cancelled" in {e.name for e in run.events}


def test_uninstrument_puts_enqueue_back_on_its_untraced_path(
    traced: Any, conn: psycopg.Connection, schema: str
) -> None:
    _, exporter = traced
    assert otel.instrumented()
    otel.uninstrument()
    assert not otel.instrumented()
    task_id = worker.enqueue(conn, "otel.any", queue="otelq", schema=schema)
    worker.enqueue_many(conn, "otel.any", [{}], queue="otelq", schema=schema)
    assert exporter.get_finished_spans() == ()
    assert conn.execute(f"SELECT count(trace_context) FROM {schema}.tasks").fetchone()[0] == 0
    assert stored_context(conn, schema, task_id) is None


def test_the_context_crosses_into_a_real_worker_process_run_with_worker_otel_set(
    traced: Any, pg_dsn: str, conn: psycopg.Connection, schema: str, tmp_path: Path
) -> None:
    provider, exporter = traced
    with provider.get_tracer("app").start_as_current_span("request"):
        worker.enqueue(conn, "otel.cross", queue="otelq", schema=schema)
    producer = one(exporter.get_finished_spans(), "send otelq")
    spans_file = tmp_path / "spans.jsonl"
    # WORKER_OTEL=1 here; the README's sample test runs `worker run --otel`.
    args = ["run", "otel_module", "--burst", "--processes", "1", "--dsn", pg_dsn]
    env = {"OTEL_TEST_SPANS": str(spans_file), "WORKER_OTEL": "1"}
    done = run_cli(*args, "--schema", schema, env=env)
    assert done.returncode == 0, done.stderr
    assert states(conn, schema) == {"done": 1}
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    consumer = next(s for s in spans if s["name"] == "process otelq")
    handler = next(s for s in spans if s["name"] == "handler work")
    trace_id, span_id = ids(producer)
    assert consumer["kind"] == "SpanKind.CONSUMER"
    assert [link["context"] for link in consumer["links"]] == [
        {"trace_id": f"0x{trace_id:032x}", "span_id": f"0x{span_id:016x}", "trace_state": "[]"}
    ]
    assert handler["parent_id"] == consumer["context"]["span_id"]


# A process where OpenTelemetry cannot be imported at all (as if the extra were not installed).
ABSENT = """
import sys

class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoOpenTelemetry())
"""


def test_without_the_extra_a_worker_imports_nothing_of_opentelemetry(
    pg_dsn: str, conn: psycopg.Connection, schema: str, tmp_path: Path
) -> None:
    """A producer and a `worker run` with neither --otel nor the package: the task runs and no
    opentelemetry module is ever loaded, in either process."""
    marker = tmp_path / "modules.json"
    produce = ABSENT + textwrap.dedent(f"""
        import worker
        worker.enqueue({pg_dsn!r}, "otel.cross", {{"marker": {str(marker)!r}}},
                       queue="otelq", schema={schema!r})
        worker.enqueue_many({pg_dsn!r}, "otel.cross", [{{}}], queue="otelq", schema={schema!r})
        loaded = [m for m in sys.modules if m.startswith("opentelemetry")]
        assert loaded == [], loaded
        from worker.cli import main
        sys.exit(main(["run", "otel_module", "--burst", "--processes", "1",
                       "--dsn", {pg_dsn!r}, "--schema", {schema!r}]))
    """)
    done = subprocess.run(
        [sys.executable, "-c", produce],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests")},
    )
    assert done.returncode == 0, done.stderr
    assert states(conn, schema) == {"done": 2}
    assert conn.execute(f"SELECT count(trace_context) FROM {schema}.tasks").fetchone()[0] == 0
    assert json.loads(marker.read_text()) == []


def test_run_otel_without_the_package_is_a_one_line_usage_error(tmp_path: Path) -> None:
    code = ABSENT + textwrap.dedent("""
        from worker.cli import main
        sys.exit(main(["run", "otel_module", "--otel", "--dsn", "postgresql://nowhere/x"]))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests")},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "worker: error: --otel needs OpenTelemetry: pip install 'worker-pg[otel]'"
        " (opentelemetry is missing)"
    ]


def test_a_bad_worker_otel_value_is_a_usage_error() -> None:
    done = run_cli("run", "otel_module", env={"WORKER_OTEL": "maybe"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "worker: error: WORKER_OTEL must be 1 or 0 (true/false), not 'maybe'"
    ]


def test_migration_0013_carries_the_grants_on_enqueue_over(
    pg_dsn: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """enqueue() gets a new signature; an operator's grant (and revoke from PUBLIC) on the old
    one hold on the new one, and callers of the old signature keep working."""
    suffix = uuid.uuid4().hex[:10]
    schema, role = f"otel_grants_{suffix}", f"otel_producer_{suffix}"
    every = _migrate.migrations()
    monkeypatch.setattr(_migrate, "migrations", lambda: [m for m in every if m.version < 13])
    _migrate.migrate(conn, schema)
    old = f"{schema}.enqueue(text, jsonb, text, timestamptz, integer, integer, text)"
    new = f"{schema}.enqueue(text, jsonb, text, timestamptz, integer, integer, text, jsonb)"
    try:
        conn.execute(f"CREATE ROLE {role} NOLOGIN")
        conn.execute(f"REVOKE EXECUTE ON FUNCTION {old} FROM PUBLIC")
        conn.execute(f"GRANT EXECUTE ON FUNCTION {old} TO {role}")
        monkeypatch.setattr(_migrate, "migrations", lambda: [m for m in every if m.version <= 13])
        assert _migrate.migrate(conn, schema) == ["0013_trace_context"]
        assert conn.execute("SELECT to_regprocedure(%s)", (old,)).fetchone()[0] is None
        grantees = conn.execute(
            "SELECT coalesce(nullif(a.grantee, 0)::regrole::text, 'PUBLIC')"
            " FROM pg_proc AS p, aclexplode(p.proacl) AS a"
            " WHERE p.oid = to_regprocedure(%s) AND a.grantee <> p.proowner",
            (new,),
        ).fetchall()
        assert grantees == [(role,)]
        # The old call, named and positional, reaches the new function (no ambiguity).
        first = conn.execute(f"SELECT {schema}.enqueue('t', dedupe_key => 'k')").fetchone()[0]
        again = conn.execute(
            f"SELECT {schema}.enqueue('t', '{{}}', NULL, now(), 0, NULL, 'k')"
        ).fetchone()[0]
        assert first == again
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.execute(f"DROP ROLE IF EXISTS {role}")


def test_a_failed_run_leaves_no_reference_cycle_to_collect(
    conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """The runner keeps the handler's exception for the run observers; once the run is over
    nothing holds it (nor, through its traceback, the handler's locals) until a GC pass."""
    reg = worker.Registry()
    raised: list[weakref.ref[BaseException]] = []

    class Boom(Exception):
        def __init__(self) -> None:
            super().__init__("boom")
            raised.append(weakref.ref(self))

    @reg.task("otel.boom", queue="otelq", max_attempts=1)
    def boom(payload: dict) -> None:
        raise Boom()  # no local holds it (that would be a cycle of the test's own)

    worker.enqueue(conn, boom, schema=schema)
    gc.disable()
    try:
        with thread_worker(reg):
            wait_until(lambda: states(conn, schema) == {"failed": 1})
        assert len(raised) == 1
        assert raised[0]() is None
    finally:
        gc.enable()
