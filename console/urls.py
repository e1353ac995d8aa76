"""The console's URLs, under ``/console/``. Stream paths may hold ``/``, so every URL that
names a stream starts with what it shows (``stream/``, ``messages/``...) and ends with the
path."""

from __future__ import annotations

from django.urls import path

from console import views

app_name = "console"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("overview.json", views.overview_data, name="overview-data"),
    path("streams/", views.stream_list, name="streams"),
    path("stream/<path:path>", views.stream_detail, name="stream"),
    path("messages/<path:path>", views.older_messages, name="messages"),
    path("append/<path:path>", views.append, name="append"),
    path("live-url/<path:path>", views.live_url, name="live-url"),
    path("state/<path:path>", views.state_detail, name="state"),
    path("entities/<path:path>", views.entities, name="entities"),
    path("yjs/<str:service>/<path:doc_path>", views.yjs_detail, name="yjs"),
    path("yjs-content/<str:service>/<path:doc_path>", views.yjs_content, name="yjs-content"),
    path("yjs-live-url/<str:service>/<path:doc_path>", views.yjs_live_url, name="yjs-live-url"),
]
