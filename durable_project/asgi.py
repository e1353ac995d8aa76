"""ASGI entry point: a Channels ``ProtocolTypeRouter``, with the ASGI lifespan in front.

``/v1/stream/...`` and ``/v1/yjs/...`` go to the lean protocol endpoints (``streams.http.app``,
``yjs.http``), which do not pass through Django's request and middleware stack: measured
here, that stack costs 5-10x the throughput of a bare ASGI app (DESIGN.md, Request path).
``/healthz`` and ``/readyz`` are lean too (``streams.http.health``). Everything else (admin,
REST API, pages) is served by Django's ASGI handler, behind a guard that bounds request bodies
(``durable_project.guard``). The lifespan (``streams.lifecycle``) starts the process's
background work and ends live readers at shutdown.
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "durable_project.settings")
django_asgi_app = get_asgi_application()

from typing import Any, cast

from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import re_path

from durable_project.guard import guarded
from streams.http.app import stream_app
from streams.http.health import health_app
from streams.lifecycle import with_lifespan
from yjs.http import yjs_app

# Channels routes ASGI applications with Django's re_path, whose types expect views.
route = cast(Any, re_path)

application = with_lifespan(
    ProtocolTypeRouter(
        {
            "http": URLRouter(
                [
                    route(r"^v1/stream/", stream_app),
                    route(r"^v1/yjs/", yjs_app),
                    route(r"^(healthz|readyz)/?$", health_app),
                    route(r"", guarded(django_asgi_app)),
                ]
            ),
        }
    )
)
