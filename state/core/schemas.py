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
from state.core.schema_cost import COST_DEPTH, SchemaCost, nested_deeper_than, schema_cost

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
    an error (docs/decisions.md).

    jsonschema-rs holds Python's global lock while it checks, so a check is bounded before it
    starts: a value is checked only if the schema's cost (``state.core.schema_cost``) times the
    value's size is within ``CHECK_BUDGET``, and a refusal is explained only within
    ``EXPLAIN_BUDGET`` (explaining an ``anyOf`` evaluates every branch); explanations never
    quote the value (``mask``). In a checker process (``bounded`` false) the deadline bounds
    it instead."""

    schema: dict[str, Any] | bool
    fast: Any
    cost: int
    recursive: bool
    plain: bool  # schema_cost.PLAIN_KEYWORDS only
    # Checked within CHECK_BUDGET and explained within EXPLAIN_BUDGET; not in a checker
    # process (state.checker), whose deadline bounds it.
    bounded: bool = True

    def work(self, size: int) -> int:
        """What checking a value of ``size`` bytes costs, in units of ``CHECK_BUDGET``."""
        return (self.cost + CONVERSION_UNITS) * max(size, 1)

    def error(self, value: Any, size: int) -> str | None:
        """Why ``value`` (``size`` bytes of JSON) fails the schema, or None."""
        work = self.work(size) if self.bounded else 0
        if self.cost >= UNCHECKABLE:
            return "at the value: cannot be checked: this schema's cost cannot be worked out"
        if work > CHECK_BUDGET:
            largest = CHECK_BUDGET // (self.cost + CONVERSION_UNITS)
            return (
                f"at the value: cannot be checked: {size} bytes against this schema would take"
                f" too long (at most {largest} bytes for it)"
            )
        if self.recursive and size > 2 * COST_DEPTH and nested_deeper_than(value, COST_DEPTH):
            return f"at the value: cannot be checked: nested deeper than {COST_DEPTH} levels"
        try:
            if self.fast.is_valid(value):
                return None
            if work > EXPLAIN_BUDGET:
                return "at the value: (too large to say where)"
            refused = next(iter(self.fast.iter_errors(value)), None)
        except ValueError as exc:  # "Recursion limit reached": nested past what it checks
            return f"at the value: cannot be checked ({exc})"
        if refused is None:
            return None
        message = refused.message
        if len(message) > MESSAGE_CHARS:  # names of unexpected properties, listed in full
            message = message[:MESSAGE_CHARS] + "..."
        return f"at {_where(list(refused.instance_path))}: {message}"


# Units: about 2 ns of jsonschema-rs's time each (a linear-time pattern takes about 1.7 ns a
# byte). A value costs (its schema's cost + CONVERSION_UNITS) x its bytes: jsonschema-rs first
# copies the value out of Python, 10-20 ns a byte of JSON. So a check holds a worker's event
# loop (and Python's lock) at most about 60 ms, and an explanation (several times the work of a
# check: every branch of an anyOf) about as long. Costs above REGISTER_MAX_COST are refused at
# registration: such a schema could check only values of a few hundred bytes.
CONVERSION_UNITS = 12
CHECK_BUDGET = 1 << 25
EXPLAIN_BUDGET = 1 << 23
REGISTER_MAX_COST = 100_000
# The cost of a schema whose cost cannot be worked out: more than any value's budget.
UNCHECKABLE = CHECK_BUDGET
# An explanation is cut to this many characters.
MESSAGE_CHARS = 500


def _where(path: list[Any]) -> str:
    return "".join(f"[{part!r}]" for part in path) or "the value"


def compile_schemas(
    schemas: dict[str, Any],
    *,
    registering: bool = False,
    bounded: bool = True,
    costs: dict[str, SchemaCost] | None = None,
) -> dict[str, SchemaValidator]:
    """A validator per entity type; SchemaError when a schema is not a valid JSON Schema,
    refers to another document (``$ref`` to a URL or a file: the server fetches nothing on a
    client's behalf, and the meta-schemas are built in) or has no bounded cost
    (``state.core.schema_cost``). When ``registering``, also when it costs more than
    ``REGISTER_MAX_COST`` (a registration stored earlier keeps its rules, and its values are
    refused by the budget instead). ``costs``: the schemas' ``schema_cost``, if the caller
    has them already."""
    compiled = {}
    for entity_type, schema in schemas.items():
        if not isinstance(schema, dict | bool):
            raise SchemaError(f"the schema of {entity_type!r} must be an object or a boolean")
        validator_for(schema).check_schema(schema)
        try:
            fast = jsonschema_rs.validator_for(
                schema, offline=True, pattern_options=jsonschema_rs.RegexOptions(), mask="value"
            )
        except (ValueError, jsonschema_rs.ValidationError) as exc:
            raise SchemaError(f"the schema of {entity_type!r} cannot be used: {exc}") from None
        try:
            cost = costs[entity_type] if costs is not None else schema_cost(schema)
        except SchemaError as exc:
            if registering:
                raise SchemaError(
                    f"the schema of {entity_type!r} cannot be used: {exc.message}"
                ) from None
            # Registered before these limits: its rules stay, and no value can be checked
            # against them (refused, saying so) rather than every value passing unchecked.
            cost = SchemaCost(UNCHECKABLE, recursive=False, plain=False)
        if registering and cost.cost > REGISTER_MAX_COST:
            raise SchemaError(
                f"the schema of {entity_type!r} is too costly to check values against: it"
                f" applies {cost.cost} keywords to one value (at most {REGISTER_MAX_COST}),"
                " counting every way $ref and the other applicators reach them"
            )
        compiled[entity_type] = SchemaValidator(
            schema, fast, cost.cost, cost.recursive, cost.plain, bounded
        )
    return compiled


def schema_error(
    event: StateEvent, size: int, validators: dict[str, SchemaValidator]
) -> str | None:
    """Why a change's value fails the schema of its type, or None when it does not (``size``:
    the event's bytes, which bound its value's)."""
    if not isinstance(event, ChangeEvent) or event.operation == "delete":
        return None
    validator = validators.get(event.type)
    if validator is None:
        return None
    error = validator.error(event.value, size)
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
    return schema_error(event, len(message), validators) or oversized(event) or unstorable(message)


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
