"""ASGI entry point: a Channels ``ProtocolTypeRouter``.

``/v1/stream/...`` and ``/v1/yjs/...`` go to the lean protocol endpoints (``streams.http.app``,
``yjs.http``), which do not pass through Django's request and middleware stack: measured
here, that stack costs 5-10x the throughput of a bare ASGI app (DESIGN.md, Request path).
Everything else (admin, REST API, pages, ``/healthz``) is served by Django's ASGI handler.
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "durable_project.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import re_path

from streams.http.app import stream_app
from yjs.http import yjs_app

application = ProtocolTypeRouter(
    {
        "http": URLRouter(
            [
                re_path(r"^v1/stream/", stream_app),
                re_path(r"^v1/yjs/", yjs_app),
                re_path(r"", django_asgi_app),
            ]
        ),
    }
)
