"""Services of the state app: registering, unregistering and catching up state streams.

Each runs in one transaction holding the stream's row lock, the same lock appends take, so a
registration and its backfill see the stream at one exact tail and no append slips between.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from jsonschema.exceptions import SchemaError

from state import checker
from state.core.schemas import compile_schemas, unstorable
from state.materializer import Progress, RebuildResult, rebuild
from state.models import EntityState, StateStream
from state.registry import REGISTRY_PATH
from streams.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    ServiceUnavailable,
)
from streams.models import Stream
from streams.protocol.headers import JSON, media_type


@dataclass(frozen=True)
class Registered:
    registration: StateStream
    created: bool
    rebuilt: RebuildResult | None


@dataclass(frozen=True)
class CaughtUp:
    stream_id: int
    applied: int  # messages materialized by this call


# Registering, unregistering and rebuilding make or drop a stream's whole state, holding one of
# the process's few Django connections for as long as that takes (seconds for a long stream),
# and those of the same stream wait for its lock with a connection each: 12 at once took every
# connection, and other clients' requests answered 503 (probe 9a). One at a time per process;
# another meanwhile is refused at once, before it takes a connection.
_rebuilding = threading.Lock()


@contextmanager
def one_rebuild_at_a_time() -> Iterator[None]:
    if not _rebuilding.acquire(blocking=False):
        raise ServiceUnavailable(
            "another state registration is being made or undone on this server; retry shortly"
        )
    try:
        yield
    finally:
        _rebuilding.release()


def locked_stream(path: str) -> Stream:
    """The live stream at ``path``, row-locked until the transaction ends."""
    stream = Stream.objects.select_for_update().with_expired().filter(path=path).first()
    if stream is None or stream.expired:  # type: ignore[attr-defined]
        raise NotFound(f"stream {path!r} not found")
    if stream.deleted_at is not None:
        raise Gone(f"stream {path!r} was deleted")
    return stream


def _next_version() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval('ds_state_version')")
        return cursor.fetchone()[0]


@dataclass(frozen=True)
class CompactionPolicy:
    """Compaction of a state stream (state/compaction.py), and how long it keeps deletes
    (None: DS_STATE__TOMBSTONE_SECS)."""

    enabled: bool
    tombstone_seconds: int | None = None


def register_state_stream(
    *,
    path: str,
    schemas: dict[str, Any],
    registered_by: str | None = None,
    compaction: CompactionPolicy | None = None,
) -> Registered:
    """Register a JSON stream as a state stream and materialize what it already holds.
    The same registration again is a no-op; a different one is a conflict (compaction is
    compared only when given)."""
    if not isinstance(schemas, dict):
        raise BadRequest("schemas must be an object mapping entity types to JSON Schemas")
    if unstorable(json.dumps(schemas).encode()):
        raise BadRequest("schemas cannot contain NUL characters or unpaired surrogates")
    try:
        validators = compile_schemas(schemas, registering=True)
    except SchemaError as exc:
        raise BadRequest(f"invalid JSON Schema: {exc.message}") from None
    except RecursionError:
        raise BadRequest("invalid JSON Schema: nested too deep") from None
    with one_rebuild_at_a_time(), transaction.atomic():
        stream = locked_stream(path)
        if media_type(stream.content_type) != JSON:
            raise Conflict(f"stream {path!r} is {stream.content_type}, not application/json")
        existing = StateStream.objects.filter(stream=stream).first()
        if existing is not None:
            if existing.schemas != schemas:
                raise Conflict(f"stream {path!r} is already registered with other schemas")
            if compaction is not None and _compaction_of(existing) != stored_policy(compaction):
                raise Conflict(f"stream {path!r} is already registered with other compaction")
            return Registered(existing, created=False, rebuilt=None)
        stored = stored_policy(compaction or CompactionPolicy(enabled=False))
        registration = StateStream.objects.create(
            stream=stream,
            schemas=schemas,
            version=_next_version(),
            registered_by=registered_by,
            compaction=stored.enabled,
            tombstone_seconds=stored.tombstone_seconds,
        )
        with checker.answered("the stream's history"):
            result = rebuild(registration, validators=validators)
    return Registered(registration, created=True, rebuilt=result)


def stored_policy(policy: CompactionPolicy) -> CompactionPolicy:
    """The policy as stored: a compacted stream's tombstone period is fixed when it is set
    (the database's compaction reads it)."""
    if not policy.enabled:
        return CompactionPolicy(enabled=False, tombstone_seconds=policy.tombstone_seconds)
    seconds = policy.tombstone_seconds
    return CompactionPolicy(True, settings.DS_STATE_TOMBSTONE_SECS if seconds is None else seconds)


def _compaction_of(registration: StateStream) -> CompactionPolicy:
    return CompactionPolicy(registration.compaction, registration.tombstone_seconds)


def unregister_state_stream(*, path: str) -> None:
    """Drop a registration and its materialized state (the stream itself stays)."""
    if path == REGISTRY_PATH:
        raise Forbidden("the registry is always a state stream")
    with one_rebuild_at_a_time(), transaction.atomic():
        stream = locked_stream(path)
        deleted, _ = StateStream.objects.filter(stream=stream).delete()
        if not deleted:
            raise NotFound(f"stream {path!r} is not a state stream")
        EntityState.objects.filter(stream=stream).delete()


def rebuild_state_stream(
    *, path: str, progress: Progress | None = None, allow_trimmed: bool = False
) -> RebuildResult:
    """Recompute a registered stream's state from its first message. A stream whose start was
    trimmed (before it was registered, or by a version that let clients trim state streams)
    is refused unless ``allow_trimmed``: rebuilt from what is left, the entities the trimmed
    events set were dropped without a word (probe 10u: 10 entities became 3)."""
    with one_rebuild_at_a_time(), transaction.atomic():
        stream = locked_stream(path)
        registration = StateStream.objects.filter(stream=stream).first()
        if registration is None:
            raise NotFound(f"stream {path!r} is not a state stream")
        if stream.first_seq > 0 and not allow_trimmed:
            raise Conflict(
                f"stream {path!r} was trimmed: its first {stream.first_seq} events are gone,"
                " and a rebuild from what is left would drop the entities they set"
                " (allow it to rebuild anyway)"
            )
        registration.stream = stream
        with checker.answered("the stream's history"):
            return rebuild(registration, progress)


def catch_up(stream_id: int) -> int:
    """Materialize everything appended to a state stream so far, waiting for a run already in
    progress; returns the messages applied. After it, the entities reflect every append
    acknowledged before the call."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT ds_state_catch_up(%s, NULL, true)", [stream_id])
        return cursor.fetchone()[0]


def catch_up_state_stream(*, path: str) -> CaughtUp | None:
    """``catch_up`` of the state stream at ``path``, found and caught up in one statement;
    None when ``path`` is not a state stream."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT r.stream_id, ds_state_catch_up(r.stream_id, NULL, true)"
            " FROM ds_state_stream AS r JOIN ds_stream AS s ON s.id = r.stream_id"
            " WHERE s.path = %s",
            [path],
        )
        row = cursor.fetchone()
    return None if row is None else CaughtUp(*row)
