"""The console's pages, the fragments and JSON they fetch, and its one write (an append).

Entry points only (STYLE.md): parse with a form, call a selector or a service, render. Live
updates come from the protocol itself: each page follows its stream over SSE through a signed
read URL (``console.keys``) and, for server-rendered parts, fetches the fragment again.
"""

from __future__ import annotations

import base64
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from console import keys, rates, selectors
from console.access import APPEND, console_view, refusal
from console.forms import AppendMessage, EntityFilters, OlderMessages, StreamFilters, errors_text
from console.services import append_message
from state.registry import REGISTRY_PATH
from streams.errors import BadRequest, NotFound, ProtocolError
from streams.http.request import MAX_PATH_BYTES
from streams.protocol.offsets import Offset
from yjs.compaction import bytes_since_snapshot
from yjs.models import YjsDocument
from yjs.paths import snapshot_key

DEFAULT_OLDER = 50
STREAM_LIST_REFRESH_MS = 10_000


def _bad_form(form: Any) -> BadRequest:
    return BadRequest(errors_text(form))


def _check_path(path: str) -> None:
    if len(path.encode()) > MAX_PATH_BYTES:
        raise BadRequest(f"stream paths are at most {MAX_PATH_BYTES} bytes")


# -- overview ----------------------------------------------------------------------------------


@console_view()
@require_GET
def overview(request: HttpRequest) -> HttpResponse:
    figures = _figures()
    config = {"figures": figures, "dataUrl": reverse("console:overview-data")}
    context = {"figures": figures, "config": config, "section": "overview"}
    return TemplateResponse(request, "console/overview.html", context)


@console_view(page=False)
@require_GET
def overview_data(request: HttpRequest) -> JsonResponse:
    return JsonResponse(_figures())


def _figures() -> dict[str, Any]:
    counts = selectors.counts()
    now = rates.current()
    return {
        "streams": counts.streams,
        "messages": counts.messages,
        "bytes": counts.bytes,
        "metrics": settings.DS_METRICS_ENABLED,
        "appends_per_second": now.appends_per_second,
        "live_readers": now.live_readers,
        "history": now.history,
    }


# -- the stream list ---------------------------------------------------------------------------


@console_view()
@require_GET
def stream_list(request: HttpRequest) -> HttpResponse:
    """The stream list; ``?fragment=rows`` answers only its rows (the page fetches them again
    when the registry says a stream appeared or went)."""
    form = StreamFilters(request.GET)
    fragment = request.GET.get("fragment") == "rows"
    if not form.is_valid():
        if fragment:
            return refusal(request, _bad_form(form), page=False)
        invalid = {"form": form, "page": None, "section": "streams"}
        return TemplateResponse(request, "console/streams.html", invalid, status=400)
    page = selectors.stream_page(form.cleaned_data)
    context: dict[str, Any] = {
        "form": form,
        "page": page,
        "next_query": _query_with(request, after=page.next_after) if page.next_after else None,
        "first_query": _query_with(request, after=None) if request.GET.get("after") else None,
        "section": "streams",
    }
    if fragment:
        return TemplateResponse(request, "console/_stream_rows.html", context)
    context["config"] = {
        "live": keys.stream_live_url(request.user, REGISTRY_PATH).as_json(),
        "liveUrlEndpoint": reverse("console:live-url", args=[REGISTRY_PATH]),
        "tail": str(selectors.stream_view(REGISTRY_PATH).tail),
        "fragmentUrl": request.path + "?" + _query_with(request, fragment="rows"),
        # Sizes and tails change without a registry event.
        "periodicMs": STREAM_LIST_REFRESH_MS,
    }
    return TemplateResponse(request, "console/streams.html", context)


def _query_with(request: HttpRequest, **changes: str | None) -> str:
    query = request.GET.copy()
    query.pop("fragment", None)
    for name, value in changes.items():
        query.pop(name, None)
        if value is not None:
            query[name] = value
    return query.urlencode()


# -- one stream --------------------------------------------------------------------------------


@console_view()
@require_GET
def stream_detail(request: HttpRequest, path: str) -> HttpResponse:
    _check_path(path)
    view = selectors.stream_view(path)
    doc = selectors.doc_of_stream(path)
    config = {
        "path": path,
        "kind": view.kind,
        "tail": str(view.tail),
        "closed": view.stream.closed,
        "live": keys.stream_live_url(request.user, path).as_json(),
        "liveUrlEndpoint": reverse("console:live-url", args=[path]),
        "messagesUrl": reverse("console:messages", args=[path]),
        "appendUrl": reverse("console:append", args=[path]),
    }
    context = {
        "view": view,
        "doc": doc,
        "config": config,
        "form": AppendMessage(),
        "can_append": request.user.has_perm(APPEND) and not view.stream.closed,
        "writable": not path.startswith("__"),
        "section": "streams",
    }
    return TemplateResponse(request, "console/stream.html", context)


@console_view(page=False)
@require_GET
def older_messages(request: HttpRequest, path: str) -> JsonResponse:
    """Stored messages before an offset, for "load older" and "go to offset"."""
    _check_path(path)
    view = selectors.stream_view(path)
    form = OlderMessages(request.GET)
    if not form.is_valid():
        raise _bad_form(form)
    before: Offset = form.cleaned_data["before"] or view.tail
    limit = form.cleaned_data["limit"] or DEFAULT_OLDER
    found = selectors.messages_before(view.stream, before, limit)
    return JsonResponse(
        {
            "before": str(before),
            "messages": [
                {
                    "offset": str(message.offset),
                    "size": message.size,
                    "data": base64.b64encode(message.data).decode(),
                    "truncated": message.truncated,
                }
                for message in found
            ],
            # Whether anything older is stored (the oldest shown is not the stream's first).
            "more": bool(found) and found[0].offset.seq > 0,
        }
    )


@console_view(page=False)
@require_GET
def live_url(request: HttpRequest, path: str) -> JsonResponse:
    """A fresh signed URL for the page's live view (it reconnects with it)."""
    _check_path(path)
    selectors.stream_view(path)
    return JsonResponse(keys.stream_live_url(request.user, path).as_json())


@console_view(APPEND, page=False)
@require_POST
async def append(request: HttpRequest, path: str) -> HttpResponse:
    """Append the form's message. Scripts get JSON (the new tail, or the refusal with its
    status); a plain form post is sent back to the stream's page."""
    user = await request.auser()
    form = AppendMessage(request.POST)
    wants_json = "application/json" in request.headers.get("Accept", "")
    try:
        _check_path(path)
        if not form.is_valid():
            raise _bad_form(form)
        result = await append_message(
            username=user.get_username(), path=path, text=form.cleaned_data["body"]
        )
    except ProtocolError as error:
        if wants_json:
            return refusal(request, error, page=False)
        messages.error(request, f"Not appended: {error.message}")
        return redirect("console:stream", path)
    if wants_json:
        return JsonResponse({"next_offset": str(result.next_offset)})
    messages.success(request, f"Appended; the tail is now {result.next_offset}.")
    return redirect("console:stream", path)


# -- state streams -----------------------------------------------------------------------------


@console_view()
@require_GET
def state_detail(request: HttpRequest, path: str) -> HttpResponse:
    _check_path(path)
    view = selectors.stream_view(path)
    if view.registration is None:
        raise NotFound("not a state stream")
    form = EntityFilters(request.GET)
    context = {
        "view": view,
        "form": form,
        "config": {
            "live": keys.stream_live_url(request.user, path).as_json(),
            "liveUrlEndpoint": reverse("console:live-url", args=[path]),
            "tail": str(view.tail),
            "fragmentUrl": reverse("console:entities", args=[path]),
        },
        "section": "streams",
    } | _entities_context(view, form)
    return TemplateResponse(request, "console/state.html", context)


@console_view(page=False)
@require_GET
def entities(request: HttpRequest, path: str) -> HttpResponse:
    """The entities fragment of a state stream's page, caught up to every acknowledged append."""
    _check_path(path)
    view = selectors.stream_view(path)
    if view.registration is None:
        raise BadRequest(f"{path!r} is not a state stream")
    form = EntityFilters(request.GET)
    if not form.is_valid():
        raise _bad_form(form)
    return TemplateResponse(request, "console/_entities.html", _entities_context(view, form))


def _entities_context(view: selectors.StreamView, form: EntityFilters) -> dict[str, Any]:
    registration = selectors.caught_up_registration(view.stream)
    filters = form.cleaned_data if form.is_valid() else {}
    groups, types = selectors.entity_groups(
        view.stream.pk, type_=filters.get("type") or "", key=filters.get("key") or ""
    )
    return {
        "registration": registration,
        "groups": groups,
        "per_type": selectors.ENTITIES_PER_TYPE,
        "types_not_shown": types - len(groups),
    }


# -- Yjs documents -----------------------------------------------------------------------------


@console_view()
@require_GET
def yjs_detail(request: HttpRequest, service: str, doc_path: str) -> HttpResponse:
    _check_path(doc_path)
    doc = selectors.document(service, doc_path)
    context = {
        "doc": doc,
        "config": {
            "live": keys.doc_live_url(request.user, service, doc_path).as_json(),
            "liveUrlEndpoint": reverse("console:yjs-live-url", args=[service, doc_path]),
            "tail": str(Offset(doc.stream.next_seq, doc.stream.next_pos)),
            "kind": "binary",
            "fragmentUrl": reverse("console:yjs-content", args=[service, doc_path]),
        },
        "section": "streams",
    } | _document_context(doc)
    return TemplateResponse(request, "console/yjs.html", context)


@console_view(page=False)
@require_GET
def yjs_content(request: HttpRequest, service: str, doc_path: str) -> HttpResponse:
    _check_path(doc_path)
    doc = selectors.document(service, doc_path)
    return TemplateResponse(request, "console/_yjs_content.html", _document_context(doc))


@console_view(page=False)
@require_GET
def yjs_live_url(request: HttpRequest, service: str, doc_path: str) -> JsonResponse:
    _check_path(doc_path)
    selectors.document(service, doc_path)
    return JsonResponse(keys.doc_live_url(request.user, service, doc_path).as_json())


def _document_context(doc: YjsDocument) -> dict[str, Any]:
    return {
        "doc": doc,
        "content": selectors.document_content(doc),
        "since_snapshot": bytes_since_snapshot(doc),
        "threshold": settings.YJS_COMPACTION_THRESHOLD_BYTES,
        "snapshot_key": snapshot_key(doc.snapshot.covers) if doc.snapshot else None,
        "tail": Offset(doc.stream.next_seq, doc.stream.next_pos),
    }
