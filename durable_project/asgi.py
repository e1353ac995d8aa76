"""ASGI entry point: a Channels ``ProtocolTypeRouter``, with the ASGI lifespan in front.

``/v1/stream/...`` and ``/v1/yjs/...`` go to the lean protocol endpoints (``streams.http.app``,
``yjs.http``; the reserved ``/v1/stream/__ds/`` control prefix first, to ``subscriptions.http``),
which do not pass through Django's request and middleware stack: measured here, that stack
costs 5-10x the throughput of a bare ASGI app (DESIGN.md, Request path).
``/healthz``, ``/readyz`` and ``/metrics`` are lean too (``streams.http.health``). Everything
else (admin, REST API, pages) is served by Django's ASGI handler, behind a guard that bounds
request bodies (``durable_project.guard``). Every route is observed the same way
(``streams.http.observe``: a request id, metrics, one log line). The lifespan
(``streams.lifecycle``) starts the process's background work and ends live readers at shutdown.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback

from django.core.asgi import get_asgi_application
from django.core.exceptions import ImproperlyConfigured

from durable_project.process import share_metrics_directory, tune_malloc

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "durable_project.settings")
try:
    share_metrics_directory()
    tune_malloc()
    django_asgi_app = get_asgi_application()
except Exception as exc:  # noqa: BLE001 - every failure here is one of starting
    # A setting the server cannot run with (or anything else that fails every worker the same
    # way as it loads). Exit status 3 is uvicorn's STARTUP_FAILURE: its supervisor stops,
    # where any other status made it start the next worker, to fail the same way, again and
    # again (probe 10f: 32 workers in 22 s, port bound, nothing served).
    if not isinstance(exc, ImproperlyConfigured):
        traceback.print_exc()
    sys.stderr.write(f"refusing to start: {exc}\n")
    sys.exit(3)

from typing import Any, cast

from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import re_path

from durable_project.guard import guarded
from streams.http.app import stream_app
from streams.http.health import health_app, metrics_app
from streams.http.observe import django_route, observed
from streams.lifecycle import with_lifespan
from streams.tracing import traced
from subscriptions.http import control_app
from yjs.http import yjs_app

# Channels routes ASGI applications with Django's re_path, whose types expect views.
route = cast(Any, re_path)

# The protocol's endpoints, by the beginning of their path; the reserved control prefix first
# (PROTOCOL.md 6).
LEAN = (
    ("v1/stream/__ds/", observed(control_app, "subscriptions")),
    ("v1/stream/", observed(stream_app, "stream")),
    ("v1/yjs/", observed(yjs_app, "yjs")),
)

router = ProtocolTypeRouter(
    {
        "http": URLRouter(
            [
                *(route(f"^{prefix}", app) for prefix, app in LEAN),
                route(r"^(healthz|readyz)/?$", observed(health_app, "probe")),
                route(r"^metrics/?$", observed(metrics_app, "metrics")),
                route(r"", observed(guarded(django_asgi_app), django_route)),
            ]
        ),
    }
)
_LEAN_PATHS = tuple((f"/{prefix}", app) for prefix, app in LEAN)


async def dispatch(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A request to the protocol's endpoints goes straight to them: Channels' router matches
    a regular expression per route and copies the scope, 10-15 us a request. Everything else
    (and any request under a root path) goes through the router, which sends what the
    endpoints do not serve to Django."""
    if scope["type"] == "http" and not scope.get("root_path"):
        path = scope["path"]
        for prefix, app in _LEAN_PATHS:
            if path.startswith(prefix):
                await app(scope, receive, send)
                return
    await router(scope, receive, send)


application = with_lifespan(traced(dispatch))

# Everything imported so far lives as long as the process: moved out of the cyclic garbage
# collector's reach, a collection no longer walks Django's and the apps' module graph again.
# Measured: 7% less CPU per append, 5% lower round trip (docs/benchmarks.md).
gc.collect()
gc.freeze()
