"""Validation of appends to registered state streams (plugged into ``streams.extensions``).

Every message of an append to a state stream must be a valid State Event, and a change's value
must match the JSON Schema registered for its type, or the whole append is refused with 400
naming the event's index and the reason; nothing of it is stored.

Registrations are cached per process, at most DS_STATE__CACHED_REGISTRATIONS of them (the least
recently used dropped first: a soak probe saw a process keep every deleted state stream's
compiled schemas, 75 KB each). A stream missing from the cache is assumed unregistered; the
write path refuses an append validated under a stale assumption (``validation_stale``), and the
caller asks again with ``refresh=True``, which reloads the registration from the database.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from state import checker
from state.core import InvalidEvent, parse_event
from state.core.schema_cost import schema_cost
from state.core.schemas import (
    CONVERSION_UNITS,
    SchemaError,
    SchemaValidator,
    compile_schemas,
    rejection,
)
from streams import metrics
from streams.errors import BadRequest
from streams.store.pool import connection


@dataclass(frozen=True, slots=True)
class Registration:
    version: int
    schemas: dict[str, Any]  # as registered, for state.checker's processes
    # Compiled here when every schema is made of PLAIN_KEYWORDS (None otherwise): small
    # appends are checked in this process, without the round trip to a checker.
    plain: dict[str, SchemaValidator] | None = None
    plain_cost: int = 0  # the costliest of ``plain``'s schemas


_registrations: dict[str, Registration] = {}
# Appends of more events than this are parsed off the event loop (streams without schemas); plain
# schemas are checked here up to this many events and this much work (CHECK_BUDGET's units:
# about 2 ms), in a checker's process past it.
INLINE_EVENTS = 500
INLINE_WORK = 1 << 20

_LOAD_SQL = (
    "SELECT r.version, r.schemas FROM ds_state_stream AS r"
    " JOIN ds_stream AS s ON s.id = r.stream_id WHERE s.path = %s"
)


async def _load(path: str) -> Registration | None:
    async with connection() as conn:
        cur = await conn.execute(_LOAD_SQL, (path,))
        row = await cur.fetchone()
    if row is None:
        _registrations.pop(path, None)
        metrics.STATE_CACHED_REGISTRATIONS.set(len(_registrations))
        return None
    version, schemas = row
    cached = _registrations.get(path)
    if cached is not None and cached.version == version:
        return _cached(path)  # versions change with every registration: the same rules
    schemas = schemas if isinstance(schemas, dict) else {}
    plain = await asyncio.to_thread(_plain, schemas)
    costliest = max((v.cost for v in plain.values()), default=0) if plain else 0
    registration = Registration(version, schemas, plain, costliest)
    _registrations.pop(path, None)
    _registrations[path] = registration
    while len(_registrations) > settings.DS_STATE_CACHED_REGISTRATIONS:
        del _registrations[next(iter(_registrations))]  # the least recently used
    metrics.STATE_CACHED_REGISTRATIONS.set(len(_registrations))
    return registration


def _plain(schemas: dict[str, Any]) -> dict[str, SchemaValidator] | None:
    """The schemas compiled, if they are all plain (``PLAIN_KEYWORDS``), else None: looked at
    first, so that schemas checked in a checker process are not compiled here too (compiling
    holds Python's lock)."""
    try:
        costs = {name: schema_cost(schema) for name, schema in schemas.items()}
        if not all(cost.plain for cost in costs.values()):
            return None
        return compile_schemas(schemas, costs=costs)
    except (SchemaError, RecursionError):  # checked at registration; never expected
        return None


def _cached(path: str) -> Registration | None:
    """The cached registration of ``path``, now the most recently used (a dict keeps the
    order of insertion: moved to the end)."""
    registration = _registrations.pop(path, None)
    if registration is not None:
        _registrations[path] = registration
    return registration


async def validate_state_append(
    path: str, values: list[Any], messages: list[bytes], refresh: bool
) -> int | None:
    registration = await _load(path) if refresh else _cached(path)
    if registration is None:
        return None
    try:
        await _judge(path, values, messages, registration)
    except BadRequest:
        if refresh:
            raise
        # Refused by cached rules: make sure they are still the stream's before answering.
        current = await _load(path)
        if current is registration:
            raise
        if current is None:
            return None
        await _judge(path, values, messages, current)
        return current.version
    return registration.version


async def _judge(
    path: str, values: list[Any], messages: list[bytes], registration: Registration
) -> None:
    """Raise BadRequest for the first refused event of an append, naming its index. Against
    plain schemas (``PLAIN_KEYWORDS``: the cost bound holds for them) a small append is checked
    here; against other schemas, or a larger append, in ``state.checker``'s processes, under a
    deadline (a refusal when it passes); without schemas, here, thousands of events off the
    event loop."""
    plain = registration.plain
    if registration.schemas and plain is not None and _small(registration, messages):
        _validate_append(values, messages, plain)
        return
    if registration.schemas:
        with checker.answered("the append"):
            refusal = await checker.check(
                path, registration.version, registration.schemas, messages
            )
        if refusal is not None:
            raise BadRequest(refusal)
    elif len(messages) <= INLINE_EVENTS:
        _validate_append(values, messages, {})
    else:
        await asyncio.to_thread(_validate_append, values, messages, {})


def _small(registration: Registration, messages: list[bytes]) -> bool:
    """Whether an append is small enough to be checked against plain schemas here."""
    work = (registration.plain_cost + CONVERSION_UNITS) * sum(map(len, messages))
    return len(messages) <= INLINE_EVENTS and work <= INLINE_WORK


def _validate_append(
    values: list[Any], messages: list[bytes], validators: dict[str, SchemaValidator]
) -> None:
    """Raise BadRequest for the first refused event."""
    for index, (value, message) in enumerate(zip(values, messages, strict=True)):
        try:
            event = parse_event(value)
        except InvalidEvent as exc:
            raise BadRequest(f"event {index}: not a valid state event: {exc}") from None
        reason = rejection(event, message, validators)
        if reason is not None:
            raise BadRequest(f"event {index}: {reason}")
