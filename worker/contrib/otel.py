"""OpenTelemetry tracing for producers and workers (``pip install 'worker-pg[otel]'``).

Call ``instrument()`` once per process (or run ``worker run --otel``, or set ``WORKER_OTEL=1``).
Then, following the OpenTelemetry messaging semantic conventions:

* every ``enqueue`` / ``enqueue_async`` is a PRODUCER span "send <queue>", and every
  ``enqueue_many`` one such span for the whole batch (``messaging.batch.message_count``); the
  span's context is stored with the row(s) (column ``trace_context``, schema/0013) by the global
  propagator (W3C ``traceparent``/``tracestate`` unless configured otherwise);
* every run of a handler is a CONSUMER span "process <queue>", linked to the producer's span
  (a link, as the conventions recommend for consumers: a task may run long after, and many times)
  and current while the handler runs, so the handler's own spans are its children. A failed run
  has status ERROR and the exception recorded; ``worker.task.outcome`` says what comes next:
  "done", "retry", "failed" (for good) or "cancelled";
* a workflow (``enqueue_workflow``) is one PRODUCER span ("send", or "send <queue>" when its
  steps share one; ``worker.workflow.name`` and ``worker.workflow.id``) whose context every step
  stores, and each step's CONSUMER span is its child, not a link: the steps of a workflow share
  its trace, and each carries ``worker.workflow.id``.

A row written without a context (a plain SQL INSERT, ``worker enqueue``, cron) runs with a root
consumer span. A context that is not a small JSON object of strings is ignored, never trusted.
Spans go to the global tracer provider unless one is passed to ``instrument``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode

from .. import hooks as _hooks
from ..engine.job import Job, Outcome

__all__ = ["MESSAGING_SYSTEM", "instrument", "instrumented", "uninstrument"]

# messaging.system: the conventions' well-known values name the broker a client talks to (kafka,
# rabbitmq, aws_sqs, ...) and allow any other for other systems. Here the queue's semantics (its
# claims, leases, retries) are this library's, not PostgreSQL's ("postgresql" is a db.system
# value, for database client spans), so the system is named after the library.
MESSAGING_SYSTEM = "worker"
# A stored context larger than this is not a trace context: it is ignored.
MAX_CONTEXT_CHARS = 8192

_state: dict[str, Any] = {}


def instrument(tracer_provider: trace.TracerProvider | None = None) -> None:
    """Trace every enqueue and every run of this process from now on (idempotent)."""
    uninstrument()
    tracer = trace.get_tracer("worker", _version(), tracer_provider=tracer_provider)
    observer = _RunObserver(tracer)
    producer = _producer(tracer)
    _hooks.producers.append(producer)
    _hooks.runs.append(observer)
    _state.update(producer=producer, observer=observer)


def uninstrument() -> None:
    """Stop tracing: the core is back to its untraced paths."""
    producer, observer = _state.pop("producer", None), _state.pop("observer", None)
    if producer in _hooks.producers:
        _hooks.producers.remove(producer)
    if observer in _hooks.runs:
        _hooks.runs.remove(observer)


def instrumented() -> bool:
    return "producer" in _state


def _version() -> str:
    try:
        return version("worker-pg")
    except PackageNotFoundError:
        return "0"


# -- producer ------------------------------------------------------------------------------------


def _producer(tracer: trace.Tracer) -> Any:
    @contextlib.contextmanager
    def send(s: _hooks.Send) -> Iterator[None]:
        attributes: dict[str, Any] = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
        }
        if s.task:
            attributes["worker.task.name"] = s.task
        if s.workflow is not None:
            attributes["worker.workflow.name"] = s.workflow
        if s.queue is not None:
            attributes["messaging.destination.name"] = s.queue
        # Without a queue the database routes the row (schema/0006): the name is then the
        # operation alone, as the conventions say for an unknown destination.
        name = "send" if s.queue is None else f"send {s.queue}"
        with tracer.start_as_current_span(
            name, kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            propagate.inject(s.carrier)
            yield
            if s.workflow_id is not None:
                span.set_attribute("worker.workflow.id", s.workflow_id)
            if s.batch:
                span.set_attribute("messaging.batch.message_count", s.count)
            elif s.task_id is not None:
                span.set_attribute("messaging.message.id", str(s.task_id))

    return send


# -- consumer ------------------------------------------------------------------------------------


class _RunObserver:
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start(self, job: Job) -> Any:
        c = job.claimed
        producer = _producer_context(c.trace_context)
        attributes: dict[str, Any] = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": c.queue,
            "messaging.message.id": str(c.id),
            "worker.task.name": c.task,
            "worker.task.attempt": c.attempt,
            "worker.task.max_attempts": c.max_attempts,
        }
        parent = None
        links = [Link(producer)] if producer is not None else []
        if c.workflow_id is not None:
            attributes["worker.workflow.id"] = c.workflow_id
            if producer is not None:
                # A workflow's steps are one piece of work: each step's run is a child of the
                # span that enqueued the workflow, so all of them are in its trace.
                parent, links = trace.set_span_in_context(NonRecordingSpan(producer)), []
        span = self._tracer.start_span(
            f"process {c.queue}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes=attributes,
        )
        return span, context.attach(trace.set_span_in_context(span))

    def end(self, token: Any, job: Job, outcome: Outcome, exc: BaseException | None) -> None:
        span, attached = token
        try:
            fate = _fate(job, outcome)
            span.set_attribute("worker.task.outcome", fate)
            if fate == "done":
                return
            if exc is not None:
                span.record_exception(exc)
                span.set_attribute("error.type", type(exc).__qualname__)
            reason = (outcome.error or "cancelled").split("\n", 1)[0]
            span.set_status(Status(StatusCode.ERROR, reason))
            span.add_event(f"worker.task.{fate}", {"worker.task.attempt": job.attempt})
        finally:
            context.detach(attached)
            span.end()


def _fate(job: Job, outcome: Outcome) -> str:
    """What the acknowledgement makes of the run: the same rules as the complete and retry
    statements (the store's acknowledgements): a cancel request wins over any outcome."""
    if job.cancel_requested:
        return "cancelled"
    if outcome.ok:
        return "done"
    max_attempts = job.claimed.max_attempts
    if outcome.permanent or (max_attempts is not None and job.attempt >= max_attempts):
        return "failed"
    return "retry"


def _producer_context(raw: str | None) -> SpanContext | None:
    """The producer's span, from the stored context; None for a row without a valid one (a
    plain INSERT, or something hostile)."""
    if not raw or len(raw) > MAX_CONTEXT_CHARS:
        return None
    try:
        carrier = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return None
    if not isinstance(carrier, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in carrier.items()
    ):
        return None
    producer = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    return producer if producer.is_valid else None
