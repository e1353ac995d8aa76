"""Rebuilding a state stream's entities from its whole history, in Python.

Used when a stream is registered (its history predates the registration, so it was never
validated), by ``manage.py materialize_state --rebuild``, and after a schema change. The caller
holds the stream's row lock (``SELECT ... FOR UPDATE`` in a transaction), so no append can
interleave: the rebuilt state is exactly the stream's, up to its tail.

Events that are not valid State Events, or whose value fails the registered schema, are
skipped and counted (``invalid_events``, ``last_error``); they never reach the state.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from django.db import connection

from state.checker import HistoryChecker
from state.core import MaterializedState, parse_event
from state.core.events import ChangeEvent
from state.core.schemas import CONVERSION_UNITS, SchemaValidator, compile_schemas, judge
from state.models import StateStream
from streams.models import Message, Stream
from streams.protocol.offsets import Offset

CHUNK = 5000
# Stored messages judged per round trip to a history checker (state.checker), and the work
# (CHECK_BUDGET's units, about 2 ms) of a chunk of plain schemas judged here.
CHECK_CHUNK = 500
INLINE_WORK = 1 << 20
Progress = Callable[[int, int], None]  # (events read, events in the stream)


@dataclass(frozen=True)
class RebuildResult:
    events: int
    entities: int
    invalid_events: int
    last_error: str


def messages(stream: Stream) -> Iterator[tuple[int, int, bytes]]:
    """(seq, pos, data) of every message of the stream, through its fork chain, in order."""
    for stream_id, lower, upper in stream.segments():
        rows = (
            Message.objects.filter(stream_id=stream_id, seq__gte=lower, seq__lt=upper)
            .order_by("seq")
            .values_list("seq", "pos", "data")
        )
        for seq, pos, data in rows.iterator(chunk_size=CHUNK):
            yield seq, pos, bytes(data)


def rebuild(
    registration: StateStream,
    progress: Progress | None = None,
    validators: dict[str, SchemaValidator] | None = None,
) -> RebuildResult:
    """Recompute and replace the entities of a registered stream (row lock held by caller);
    ``validators``: its schemas, when the caller has compiled them already."""
    stream = registration.stream
    if validators is None or any(v.bounded for v in validators.values()):
        # Judged as appends are: no size budget (a checker's deadline bounds the costly ones).
        validators = compile_schemas(registration.schemas, bounded=False)
    state = MaterializedState()
    invalid = 0
    last_error = ""
    count = 0
    # Schemas beyond the plain keywords, and chunks too large to check here in a few
    # milliseconds, are checked in a process of its own, under the check's deadline
    # (state.checker).
    plain = all(v.plain for v in validators.values())
    unit = max((v.cost for v in validators.values()), default=0) + CONVERSION_UNITS
    history: HistoryChecker | None = None
    try:
        for chunk in _chunks(messages(stream), CHECK_CHUNK):
            reasons = None
            if validators and (not plain or unit * sum(len(r[2]) for r in chunk) > INLINE_WORK):
                history = history or HistoryChecker(registration.schemas)
                reasons = history.reasons([data for _, _, data in chunk])
            for index, (seq, pos, data) in enumerate(chunk):
                count += 1
                offset = str(Offset(seq, pos))
                if reasons is None:
                    event, reason = judge(data, validators)
                else:
                    reason = reasons[index]
                    event = None if reason is not None else parse_event(json.loads(data))
                if event is None:
                    invalid += 1
                    last_error = f"event at offset {offset}: {reason}"
                    continue
                if isinstance(event, ChangeEvent) and event.operation != "delete":
                    # Keep the offset with the value: the same semantics decide which survives.
                    event = replace(event, value=(event.value, offset))
                state.apply(event)
                if progress is not None and count % CHUNK == 0:
                    progress(count, stream.next_seq)
    finally:
        if history is not None:
            history.close()

    _replace_entities(stream.pk, state.items())
    registration.materialized_seq = stream.next_seq
    registration.materialized_pos = stream.next_pos
    registration.invalid_events = invalid
    registration.last_error = last_error
    registration.save(
        update_fields=["materialized_seq", "materialized_pos", "invalid_events", "last_error"]
    )
    if progress is not None:
        progress(count, stream.next_seq)
    return RebuildResult(count, len(state), invalid, last_error)


def _chunks(
    rows: Iterator[tuple[int, int, bytes]], size: int
) -> Iterator[list[tuple[int, int, bytes]]]:
    chunk: list[tuple[int, int, bytes]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _replace_entities(stream_id: int, items: Iterator[tuple[str, str, Any]]) -> None:
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM ds_entity WHERE stream_id = %s", [stream_id])
        copy_sql = "COPY ds_entity (stream_id, type, key, value, event_offset) FROM STDIN"
        with cursor.cursor.copy(copy_sql) as copy:
            for entity_type, key, (value, offset) in items:
                copy.write_row((stream_id, entity_type, key, json.dumps(value), offset))
