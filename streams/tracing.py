"""Optional OpenTelemetry tracing of requests and database calls.

On only when the standard variables ask for it (``OTEL_TRACES_EXPORTER``,
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED``
wins): then every request is a span (the ASGI instrumentation) and every statement a child
span (the psycopg instrumentation), exported in batches by OTLP over HTTP, or printed with
``OTEL_TRACES_EXPORTER=console``. ``OTEL_SERVICE_NAME`` names the service (default
``durable-streams``). Off, nothing of OpenTelemetry is even imported: it costs nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

_ASKED_BY = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)


def enabled() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    return any(os.environ.get(name) for name in _ASKED_BY)


# Set once tracing is on (traced()): statements that do not go through psycopg's cursors
# (streams.store.prepared) make their spans themselves.
_tracer: Any = None


@contextlib.contextmanager
def statement(sql: str) -> Iterator[None]:
    """A span for one database statement run without psycopg's cursors, named and described
    as the psycopg instrumentation names its own; nothing when tracing is off."""
    if _tracer is None:
        yield
        return
    from opentelemetry.trace import SpanKind

    name = sql.split(None, 1)[0]
    attributes = {"db.system": "postgresql", "db.statement": sql}
    with _tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes):
        yield


def traced(app: Any) -> Any:
    """``app`` with tracing when the environment asks for it, else ``app`` itself."""
    global _tracer
    if not enabled():
        return app
    from opentelemetry import trace
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    service = os.environ.get("OTEL_SERVICE_NAME") or "durable-streams"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    PsycopgInstrumentor().instrument()
    _tracer = trace.get_tracer("durable-streams")
    return OpenTelemetryMiddleware(app)
