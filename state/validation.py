"""Validation of appends to registered state streams (plugged into ``streams.extensions``).

Every message of an append to a state stream must be a valid State Event, and a change's value
must match the JSON Schema registered for its type, or the whole append is refused with 400
naming the event's index and the reason; nothing of it is stored.

Registrations are cached per process. A stream missing from the cache is assumed unregistered;
the write path refuses an append validated under a stale assumption (``validation_stale``), and
the caller asks again with ``refresh=True``, which reloads the registration from the database.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jsonschema_rs
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from state.core import InvalidEvent, parse_event
from state.core.events import ChangeEvent, StateEvent
from streams.errors import BadRequest
from streams.store.pool import get_pool


@dataclass(frozen=True, slots=True)
class SchemaValidator:
    """One entity type's schema. The hot path asks jsonschema-rs (compiled once, ~50x faster
    than the pure-Python validator); a value it refuses is explained by ``jsonschema``, whose
    messages and paths are the reference (docs/decisions.md)."""

    schema: dict[str, Any]
    fast: Any

    def error(self, value: Any) -> str | None:
        if self.fast.is_valid(value):
            return None
        explained = next(iter(validator_for(self.schema)(self.schema).iter_errors(value)), None)
        if explained is None:  # the two libraries disagree: trust the one that refused
            try:
                self.fast.validate(value)
            except jsonschema_rs.ValidationError as exc:
                return f"at {_where(list(exc.instance_path))}: {exc.message}"
            return None
        return f"at {_where(list(explained.absolute_path))}: {explained.message}"


def _where(path: list[Any]) -> str:
    return "".join(f"[{part!r}]" for part in path) or "the value"


@dataclass(frozen=True, slots=True)
class Registration:
    version: int
    validators: dict[str, SchemaValidator]


_registrations: dict[str, Registration] = {}

_LOAD_SQL = (
    "SELECT r.version, r.schemas FROM ds_state_stream AS r"
    " JOIN ds_stream AS s ON s.id = r.stream_id WHERE s.path = %s"
)


def compile_schemas(schemas: dict[str, Any]) -> dict[str, SchemaValidator]:
    """A validator per entity type; SchemaError when a schema is not a valid JSON Schema."""
    compiled = {}
    for entity_type, schema in schemas.items():
        if not isinstance(schema, dict | bool):
            raise SchemaError(f"the schema of {entity_type!r} must be an object or a boolean")
        validator_for(schema).check_schema(schema)
        try:
            fast = jsonschema_rs.validator_for(schema)
        except (ValueError, jsonschema_rs.ValidationError) as exc:
            raise SchemaError(f"the schema of {entity_type!r} cannot be used: {exc}") from None
        compiled[entity_type] = SchemaValidator(schema, fast)
    return compiled


async def _load(path: str) -> Registration | None:
    pool = await get_pool()
    async with pool.connection() as conn:
        cur = await conn.execute(_LOAD_SQL, (path,))
        row = await cur.fetchone()
    if row is None:
        _registrations.pop(path, None)
        return None
    version, schemas = row
    try:
        registration = Registration(version, compile_schemas(schemas))
    except SchemaError:  # stored schemas are checked at registration; never expected
        registration = Registration(version, {})
    _registrations[path] = registration
    return registration


def schema_error(event: StateEvent, validators: dict[str, SchemaValidator]) -> str | None:
    """Why a change's value fails the schema of its type, or None when it does not."""
    if not isinstance(event, ChangeEvent) or event.operation == "delete":
        return None
    validator = validators.get(event.type)
    if validator is None:
        return None
    error = validator.error(event.value)
    if error is None:
        return None
    return f"value of type {event.type!r} does not match its schema {error}"


def validate_events(values: list[Any], validators: dict[str, SchemaValidator]) -> None:
    """Raise BadRequest for the first invalid event, naming its index in the append."""
    for index, value in enumerate(values):
        try:
            event = parse_event(value)
        except InvalidEvent as exc:
            raise BadRequest(f"event {index}: not a valid state event: {exc}") from None
        reason = schema_error(event, validators)
        if reason is not None:
            raise BadRequest(f"event {index}: {reason}")


async def validate_state_append(
    path: str, values: list[Any], messages: list[bytes], refresh: bool
) -> int | None:
    registration = await _load(path) if refresh else _registrations.get(path)
    if registration is None:
        return None
    try:
        _validate_append(values, messages, registration.validators)
    except BadRequest:
        if refresh:
            raise
        # Refused by cached rules: make sure they are still the stream's before answering.
        registration = await _load(path)
        if registration is None:
            return None
        _validate_append(values, messages, registration.validators)
    return registration.version


def _validate_append(
    values: list[Any], messages: list[bytes], validators: dict[str, SchemaValidator]
) -> None:
    validate_events(values, validators)
    for index, message in enumerate(messages):
        reason = unstorable(message)
        if reason is not None:
            raise BadRequest(f"event {index}: {reason}")


# JSON that PostgreSQL's jsonb cannot hold: the NUL character and unpaired surrogates. Our JSON
# encoder writes both as \u escapes (streams.protocol.json_mode), so a byte search finds them:
# a backslash-u that is not itself escaped, followed by 0000 or a surrogate.
_UNSTORABLE = re.compile(rb"(?<!\\)(?:\\\\)*\\u(?:0000|d[89a-f][0-9a-f]{2})")


def unstorable(message: bytes) -> str | None:
    """Why an encoded event cannot be materialized, or None."""
    if _UNSTORABLE.search(message):
        return "state events cannot contain NUL characters or unpaired surrogates"
    return None
