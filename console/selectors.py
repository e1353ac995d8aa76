"""What the console's pages read (selectors, STYLE.md): streams, stored messages, entities and
Yjs documents, through the ORM. The console writes only through the protocol's services."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db.models import (
    Case,
    Count,
    Exists,
    F,
    JSONField,
    OuterRef,
    Q,
    QuerySet,
    Sum,
    When,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, Length

from state.models import EntityState, StateStream
from state.services import catch_up_state_stream
from streams.errors import BadRequest, NotFound
from streams.models import Message, Producer, Stream
from streams.preview import stored_head
from streams.protocol.headers import is_json, is_text_for_sse, media_type
from streams.protocol.offsets import Offset
from yjs.compaction import updates_since_snapshot
from yjs.engine import EngineTimeout, EngineUnavailable, Refused, blocking_engine
from yjs.models import YjsDocument
from yjs.paths import INTERNAL_PREFIX as YJS_PREFIX
from yjs.paths import DocRef

PAGE_SIZE = 100
ENTITIES_PER_TYPE = 200
# The largest entity value the state page shows (bytes of its JSON text, kept by PostgreSQL:
# ``value_bytes``); larger ones are named by their size and not read. Every value was read
# (50 types of 200 entities, whatever each held: a writer's 2 MB values made a page of
# gigabytes; probe 10b found it on the REST API's pages).
VALUE_PREVIEW_BYTES = 4096
TYPES_SHOWN = 50
# The overview's counts scan the stream table: at most once per this many seconds per process.
COUNTS_TTL_SECS = 5.0


# -- the stream list ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamPage:
    streams: list[Stream]
    next_after: str | None


def _listed() -> QuerySet[Stream]:
    registered = StateStream.objects.filter(stream=OuterRef("pk"))
    document = YjsDocument.objects.filter(stream=OuterRef("pk"))
    return (
        Stream.objects.with_expired()
        .annotate(registered=Exists(registered), yjs=Exists(document))
        .select_related("fork_source")
        .only(*LIST_FIELDS)
    )


LIST_FIELDS = (
    "path", "content_type", "created_at", "accessed_at", "ttl_seconds", "expires_at",
    "next_seq", "next_pos", "closed", "fork_source__path", "fork_seq", "fork_pos",
    "fork_refcount", "deleted_at",
)  # fmt: skip


def stream_page(filters: dict[str, Any], limit: int = PAGE_SIZE) -> StreamPage:
    """One page of streams matching ``filters`` (``forms.StreamFilters``' cleaned data),
    ordered by path, after the path ``filters["after"]``."""
    streams = _filtered(_listed(), filters)
    if filters.get("after"):
        streams = streams.filter(path__gt=filters["after"])
    rows = list(streams.order_by("path")[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return StreamPage(rows, rows[-1].path if more and rows else None)


def _filtered(streams: QuerySet[Stream], f: dict[str, Any]) -> QuerySet[Stream]:
    status = f.get("status") or "live"
    if status == "live":
        streams = streams.filter(deleted_at__isnull=True)
    elif status == "deleted":
        streams = streams.filter(deleted_at__isnull=False)
    if f.get("path_prefix"):
        streams = streams.filter(path__startswith=f["path_prefix"])
    if f.get("content_type"):
        streams = streams.filter(content_type__istartswith=f["content_type"].strip())
    if f.get("min_bytes") is not None:
        streams = streams.filter(next_pos__gte=f["min_bytes"])
    if f.get("max_bytes") is not None:
        streams = streams.filter(next_pos__lte=f["max_bytes"])
    tail: Offset | None = f.get("tail_from")
    if tail is not None:
        streams = streams.filter(
            Q(next_seq__gt=tail.seq) | Q(next_seq=tail.seq, next_pos__gte=tail.pos)
        )
    if f.get("closed"):
        streams = streams.filter(closed=f["closed"] == "yes")
    match f.get("expiry"):
        case "ttl":
            streams = streams.filter(Q(ttl_seconds__isnull=False) | Q(expires_at__isnull=False))
        case "never":
            streams = streams.filter(ttl_seconds__isnull=True, expires_at__isnull=True)
        case "expired":
            streams = streams.filter(expired=True)  # type: ignore[misc]  # annotated
    match f.get("fork"):
        case "fork":
            streams = streams.filter(fork_source__isnull=False)
        case "source":
            streams = streams.filter(fork_refcount__gt=0)
        case "plain":
            streams = streams.filter(fork_source__isnull=True, fork_refcount=0)
    if f.get("forked_from"):
        streams = streams.filter(fork_source__path__startswith=f["forked_from"])
    if f.get("state"):
        streams = streams.filter(registered=f["state"] == "yes")  # type: ignore[misc]
    return streams


# -- the overview ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    streams: int
    messages: int
    bytes: int


_counts: tuple[float, Counts] | None = None
_counts_lock = threading.Lock()


def counts() -> Counts:
    """Live streams, and the messages and bytes stored under them (a fork's own, not what it
    reads through its source), at most ``COUNTS_TTL_SECS`` old."""
    global _counts
    with _counts_lock:
        if _counts is not None and time.monotonic() - _counts[0] < COUNTS_TTL_SECS:
            return _counts[1]
    totals = Stream.objects.filter(deleted_at__isnull=True).aggregate(
        streams=Count("pk"),
        messages=Sum(F("next_seq") - Coalesce("fork_seq", 0)),
        bytes=Sum(F("next_pos") - Coalesce("fork_pos", 0)),
    )
    fresh = Counts(totals["streams"], totals["messages"] or 0, totals["bytes"] or 0)
    with _counts_lock:
        _counts = (time.monotonic(), fresh)
    return fresh


# -- one stream --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamView:
    """A stream and what the console shows around it."""

    stream: Stream
    expired: bool
    registration: StateStream | None
    document: YjsDocument | None
    producers: int

    @property
    def media_type(self) -> str:
        try:
            return media_type(self.stream.content_type)
        except BadRequest:  # stored before today's rules; shown as bytes
            return "application/octet-stream"

    @property
    def kind(self) -> str:
        """How the page renders messages: ``json``, ``text`` or ``binary``."""
        if is_json(self.media_type):
            return "json"
        return "text" if is_text_for_sse(self.media_type) else "binary"

    @property
    def tail(self) -> Offset:
        return Offset(self.stream.next_seq, self.stream.next_pos)

    @property
    def fork_offset(self) -> Offset | None:
        stream = self.stream
        if stream.fork_seq is None or stream.fork_pos is None:
            return None
        return Offset(stream.fork_seq, stream.fork_pos)


def stream_view(path: str) -> StreamView:
    """The stream at ``path`` (soft-deleted ones too: forks still read them); 404 otherwise."""
    stream = Stream.objects.with_expired().select_related("fork_source").filter(path=path).first()
    if stream is None:
        raise NotFound("no such stream")
    registration = StateStream.objects.filter(pk=stream.pk).first()
    document = YjsDocument.objects.filter(pk=stream.pk).first()
    producers = Producer.objects.filter(stream_id=stream.pk).count()
    expired = bool(getattr(stream, "expired", False))
    return StreamView(stream, expired, registration, document, producers)


@dataclass(frozen=True)
class StoredMessage:
    offset: Offset
    size: int
    data: bytes  # at most PREVIEW_BYTES of it

    @property
    def truncated(self) -> bool:
        return len(self.data) < self.size


def check_offset(stream: Stream, offset: Offset) -> None:
    """400 unless ``offset`` is a position of this stream: its tail, or where a message starts
    (the protocol's own rule, docs/gaps.md)."""
    if offset == Offset(stream.next_seq, stream.next_pos):
        return
    if offset.seq < stream.next_seq:
        for stream_id, lower, upper in stream.segments():
            if lower <= offset.seq < upper:
                pos = (
                    Message.objects.filter(stream_id=stream_id, seq=offset.seq)
                    .values_list("pos", flat=True)
                    .first()
                )
                if pos == offset.pos:
                    return
    raise BadRequest(f"{offset} is not an offset of this stream")


def messages_before(stream: Stream, before: Offset, limit: int) -> list[StoredMessage]:
    """Up to ``limit`` stored messages ending at or before ``before``, oldest first, read
    through a fork's source chain; each with at most ``PREVIEW_BYTES`` of its data."""
    check_offset(stream, before)
    found: list[StoredMessage] = []
    for stream_id, lower, upper in reversed(stream.segments()):
        end = min(upper, before.seq)
        if end <= lower:
            continue
        rows = (
            Message.objects.filter(stream_id=stream_id, seq__gte=lower, seq__lt=end)
            .annotate(size=Length("data"), head=stored_head("data"))
            .order_by("-seq")
            .values_list("seq", "pos", "size", "head")[: limit - len(found)]
        )
        found.extend(
            StoredMessage(Offset(seq, pos), size, bytes(head)) for seq, pos, size, head in rows
        )
        if len(found) >= limit:
            break
    return list(reversed(found))


# -- state streams -----------------------------------------------------------------------------


def caught_up_registration(stream: Stream) -> StateStream | None:
    """The stream's registration once its entities reflect every acknowledged append (as the
    state API does: read-your-writes)."""
    catch_up_state_stream(path=stream.path)
    return StateStream.objects.filter(pk=stream.pk).first()


@dataclass(frozen=True)
class EntityGroup:
    type: str
    total: int
    entities: list[EntityState]


def entity_groups(
    stream_id: int, *, type_: str = "", key: str = ""
) -> tuple[list[EntityGroup], int]:
    """The materialized entities of a state stream by type (the first ``TYPES_SHOWN`` types by
    name, at most ``ENTITIES_PER_TYPE`` of each, by key), with each type's count; and how many
    types there are (a writer chooses them: 5,000 made a page of 2 MB, 3.5 s to build)."""
    entities = EntityState.objects.filter(stream_id=stream_id)
    if type_:
        entities = entities.filter(entity_type=type_)
    if key:
        entities = entities.filter(key__startswith=key)
    types = entities.values_list("entity_type").annotate(n=Count("pk")).order_by("entity_type")
    groups = [
        EntityGroup(
            name,
            total,
            list(
                entities.filter(entity_type=name)
                .order_by("key")
                .defer("value")
                .annotate(value_bytes=RawSQL("value_bytes", ()))
                .annotate(
                    shown=Case(
                        When(value_bytes__lte=VALUE_PREVIEW_BYTES, then=F("value")),
                        output_field=JSONField(),
                    )
                )[:ENTITIES_PER_TYPE]
            ),
        )
        for name, total in types[:TYPES_SHOWN]
    ]
    return groups, (len(groups) if len(groups) < TYPES_SHOWN else types.count())


# -- Yjs documents -----------------------------------------------------------------------------


def document(service: str, doc_path: str) -> YjsDocument:
    found = (
        YjsDocument.objects.select_related("stream", "snapshot")
        .defer("snapshot__data")
        .filter(service=service, path=doc_path, stream__deleted_at__isnull=True)
        .first()
    )
    if found is None:
        raise NotFound("no such document")
    return found


def doc_of_stream(path: str) -> DocRef | None:
    """The Yjs document whose updates are the stream at ``path``, if it is one."""
    if not path.startswith(YJS_PREFIX):
        return None
    service, sep, doc_path = path[len(YJS_PREFIX) :].partition("/docs/")
    return DocRef(service, doc_path) if sep and service and doc_path else None


@dataclass(frozen=True)
class DocContent:
    """A document's content: each root as text (``yjs.preview``), or why it cannot be read."""

    roots: dict[str, str]
    error: str | None
    updates: int  # updates since the snapshot


# stream id -> (tail and snapshot it was rendered at, content): viewers of one document share
# one rendering per change.
_contents: dict[int, tuple[tuple[Offset, int | None], DocContent]] = {}
_contents_lock = threading.Lock()
MAX_CONTENTS = 64


def document_content(doc: YjsDocument) -> DocContent:
    """The content of the latest snapshot plus the updates since, merged with pycrdt."""
    version = (Offset(doc.stream.next_seq, doc.stream.next_pos), doc.snapshot_id)
    with _contents_lock:
        cached = _contents.get(doc.pk)
    if cached is not None and cached[0] == version:
        return cached[1]
    updates = updates_since_snapshot(doc)
    count = len(updates) - (1 if doc.snapshot_id is not None else 0)
    try:  # in the engine's process: pycrdt holds Python's lock for seconds on large ones
        content = DocContent(blocking_engine().describe(updates) if updates else {}, None, count)
    except Refused as exc:
        content = DocContent({}, f"the updates cannot be merged: {exc}", count)
    except (EngineTimeout, EngineUnavailable) as exc:
        content = DocContent({}, f"the content could not be read in time ({exc})", count)
    with _contents_lock:
        if len(_contents) >= MAX_CONTENTS:
            _contents.clear()
        _contents[doc.pk] = (version, content)
    return content


def internal(path: str) -> bool:
    return path.startswith("__")
