"""Plans for the Spark job, and publishing its result into the state tables atomically.

The job writes entities into a private staging table; ``publish`` then replaces the streams'
entities in ONE transaction holding their registrations' row locks (the lock the in-process
materializer and the state API's catch-up take), records the offset the job materialized each
stream to, and applies what was appended since with the in-process materializer's SQL. Readers
see the old state or the new one, never a mix; nothing appended during the job is lost.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction

from state.models import StateStream
from state.services import catch_up


@dataclass(frozen=True)
class PlannedStream:
    stream_id: int
    path: str
    version: int
    tail_seq: int
    tail_pos: int
    segments: list[tuple[int, int, int]]
    schemas: dict[str, Any]


def plan(paths: list[str] | None) -> list[PlannedStream]:
    """The registered streams to materialize (all when ``paths`` is None), each with the tail
    the job reads up to."""
    registrations = StateStream.objects.select_related("stream").order_by("stream__path")
    if paths is not None:
        registrations = registrations.filter(stream__path__in=paths)
        missing = set(paths) - {r.stream.path for r in registrations}
        if missing:
            raise LookupError(f"not state streams: {', '.join(sorted(missing))}")
    return [
        PlannedStream(
            stream_id=r.stream.pk,
            path=r.stream.path,
            version=r.version,
            tail_seq=r.stream.next_seq,
            tail_pos=r.stream.next_pos,
            segments=r.stream.segments(),
            schemas=r.schemas,
        )
        for r in registrations
    ]


def create_staging_table() -> str:
    name = f"ds_entity_stage_{uuid.uuid4().hex[:12]}"
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE UNLOGGED TABLE {name} (stream_id bigint NOT NULL, type text NOT NULL,"
            " key text NOT NULL, value text NOT NULL, event_offset text NOT NULL)"
        )
    return name


def drop_staging_table(name: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {name}")


@dataclass(frozen=True)
class Published:
    streams: int  # swapped in; the others were unregistered or re-registered during the job
    caught_up: int  # messages appended during the job, applied after the swap


def publish(
    staging: str, planned: list[PlannedStream], invalid: dict[int, tuple[int, str]]
) -> Published:
    """Swap in the staged entities of every planned stream whose registration is unchanged."""
    with transaction.atomic(), connection.cursor() as cursor:
        # ORDER BY fixes the lock order (rows are locked as the sorted scan returns them).
        cursor.execute(
            "SELECT stream_id, version FROM ds_state_stream WHERE stream_id = ANY(%s)"
            " ORDER BY stream_id FOR UPDATE",
            [[p.stream_id for p in planned]],
        )
        current = dict(cursor.fetchall())
        # Unregistered or re-registered during the job: leave those alone.
        accepted = [p for p in planned if current.get(p.stream_id) == p.version]
        ids = [p.stream_id for p in accepted]
        # One statement each: the staging table has no index, so it is scanned once.
        cursor.execute("DELETE FROM ds_entity WHERE stream_id = ANY(%s)", [ids])
        cursor.execute(
            f"INSERT INTO ds_entity (stream_id, type, key, value, event_offset)"
            f" SELECT stream_id, type, key, value::jsonb, event_offset FROM {staging}"
            f" WHERE stream_id = ANY(%s)",
            [ids],
        )
        caught_up = 0
        for p in accepted:
            invalid_events, last_error = invalid.get(p.stream_id, (0, ""))
            cursor.execute(
                "UPDATE ds_state_stream SET materialized_seq = %s, materialized_pos = %s,"
                " invalid_events = %s, last_error = %s WHERE stream_id = %s",
                [p.tail_seq, p.tail_pos, invalid_events, last_error, p.stream_id],
            )
            # What was appended during the job, as any catch-up applies it (row lock held).
            caught_up += catch_up(p.stream_id)
    return Published(len(accepted), caught_up)
