"""Handlers for the OpenTelemetry tests' real `worker run --otel` processes (tests/test_otel.py).

The process's spans go, one JSON object a line, to the file named by OTEL_TEST_SPANS; the handler
opens a span of its own, which must nest under the worker's consumer span. When OTEL_TEST_SPANS
is not set (the absent-extra test) nothing of OpenTelemetry is imported here.
"""

from __future__ import annotations

import json
import os
import sys

import worker

SPANS = os.environ.get("OTEL_TEST_SPANS")

if SPANS:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider()
    out = open(SPANS, "a")  # noqa: SIM115 (the process's life)
    provider.add_span_processor(
        SimpleSpanProcessor(
            ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n")
        )
    )
    trace.set_tracer_provider(provider)


@worker.task("otel.cross", queue="otelq")
def cross(payload: dict) -> None:
    if SPANS:
        with trace.get_tracer("otel_module").start_as_current_span("handler work"):
            pass
    # What the absent-extra test checks: the handler ran, and OpenTelemetry was never loaded.
    marker = payload.get("marker")
    if marker:
        with open(marker, "w") as f:
            json.dump(sorted(m for m in sys.modules if m.startswith("opentelemetry")), f)
