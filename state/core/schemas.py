"""JSON Schemas of entity values, and what PostgreSQL can store (no Django: the Spark job
uses this too, so both materializers judge events identically)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema_rs
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from state.core.events import ChangeEvent, StateEvent, parse_event

__all__ = [
    "SchemaError",
    "SchemaValidator",
    "compile_schemas",
    "judge",
    "oversized",
    "rejection",
    "schema_error",
    "unstorable",
]


@dataclass(frozen=True, slots=True)
class SchemaValidator:
    """One entity type's schema, judged and explained by jsonschema-rs, compiled once by
    ``compile_schemas`` (executors of the Spark job compile their own: it does not pickle).

    Not the pure-Python ``jsonschema`` for explanations: its ``pattern`` runs Python's
    backtracking ``re`` on client values (one 31-character string against ``^(a+)+$`` kept a
    worker busy until it was killed), and it recurses on nesting (a 500). jsonschema-rs, with
    the linear-time regular expressions of ``RegexOptions`` (lookaround and backreferences
    refused at registration: its default backtracking engine stops each match after a million
    steps, 45 ms, and a value may hold thousands of matches), reports nesting past its limit as
    an error (docs/decisions.md)."""

    schema: dict[str, Any] | bool
    fast: Any

    def error(self, value: Any) -> str | None:
        try:
            refused = next(iter(self.fast.iter_errors(value)), None)
        except ValueError as exc:  # "Recursion limit reached": nested past what it checks
            return f"at the value: cannot be checked ({exc})"
        if refused is None:
            return None
        return f"at {_where(list(refused.instance_path))}: {refused.message}"


def _where(path: list[Any]) -> str:
    return "".join(f"[{part!r}]" for part in path) or "the value"


def compile_schemas(schemas: dict[str, Any]) -> dict[str, SchemaValidator]:
    """A validator per entity type; SchemaError when a schema is not a valid JSON Schema or
    refers to another document (``$ref`` to a URL or a file: the server fetches nothing on a
    client's behalf, and the meta-schemas are built in)."""
    compiled = {}
    for entity_type, schema in schemas.items():
        if not isinstance(schema, dict | bool):
            raise SchemaError(f"the schema of {entity_type!r} must be an object or a boolean")
        validator_for(schema).check_schema(schema)
        try:
            fast = jsonschema_rs.validator_for(
                schema, offline=True, pattern_options=jsonschema_rs.RegexOptions()
            )
        except (ValueError, jsonschema_rs.ValidationError) as exc:
            raise SchemaError(f"the schema of {entity_type!r} cannot be used: {exc}") from None
        compiled[entity_type] = SchemaValidator(schema, fast)
    return compiled


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


# JSON that PostgreSQL's jsonb cannot hold: the NUL character and unpaired surrogates. Our JSON
# encoder writes both as \u escapes (streams.protocol.json_mode), so a byte search finds them:
# a backslash-u that is not itself escaped, followed by 0000 or a surrogate.
_UNSTORABLE = re.compile(rb"(?<!\\)(?:\\\\)*\\u(?:0000|d[89a-f][0-9a-f]{2})")


def unstorable(message: bytes) -> str | None:
    """Why an encoded event cannot be materialized, or None."""
    if _UNSTORABLE.search(message):
        return "state events cannot contain NUL characters or unpaired surrogates"
    return None


# An entity is found by its stream, type and key, in one btree index, whose rows hold at most
# 2,704 bytes: a change event whose type and key are longer together cannot be materialized.
MAX_IDENTITY_BYTES = 2000


def oversized(event: StateEvent) -> str | None:
    """Why a change event's type and key are too long to be materialized, or None."""
    if not isinstance(event, ChangeEvent):
        return None
    size = len(event.type.encode("utf-8", "surrogatepass")) + len(
        event.key.encode("utf-8", "surrogatepass")
    )
    if size > MAX_IDENTITY_BYTES:
        return (
            f"the type and key of a change event are at most {MAX_IDENTITY_BYTES} bytes"
            f" together (UTF-8); these are {size}"
        )
    return None


def rejection(
    event: StateEvent, message: bytes, validators: dict[str, SchemaValidator]
) -> str | None:
    """Why a State Event is refused (its value fails the schema of its type, its type and key
    are too long, or PostgreSQL cannot store its message), or None. The append validation and
    ``judge`` (both Python materializers) ask this, so all three refuse the same events for the
    same reasons."""
    return schema_error(event, validators) or oversized(event) or unstorable(message)


def judge(
    message: bytes, validators: dict[str, SchemaValidator]
) -> tuple[StateEvent, None] | tuple[None, str]:
    """A stored message as a materializer sees it: ``(event, None)``, or ``(None, reason)``
    when it is not JSON, not a State Event, fails its schema or cannot be stored."""
    try:
        event = parse_event(json.loads(message))
    except ValueError as exc:  # not JSON, or not a State Event (InvalidEvent)
        return None, str(exc)
    reason = rejection(event, message, validators)
    if reason is not None:
        return None, reason
    return event, None
