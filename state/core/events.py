"""State Events: parsing, validation and type guards.

A State Event is a JSON object that is either a Change Event (``headers.operation``) or a
Control Event (``headers.control``) (state-protocol-0.1.md 4). ``parse_event`` turns a decoded
JSON value into a typed, immutable event or raises ``InvalidEvent`` saying what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypeGuard

CHANGE_OPERATIONS = ("insert", "update", "delete")
CONTROLS = ("snapshot-start", "snapshot-end", "up-to-date", "reset")

Operation = Literal["insert", "update", "delete"]
Control = Literal["snapshot-start", "snapshot-end", "up-to-date", "reset"]

# RFC 3339 date-time (STATE-PROTOCOL.md 5.1: headers.timestamp).
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", re.ASCII
)
_LEAP_SECOND = re.compile(r"(T\d{2}:\d{2}):60", re.ASCII)
# Offsets never contain these (PROTOCOL.md 8).
_OFFSET_FORBIDDEN = re.compile(r"[,&=?/]")


class InvalidEvent(ValueError):
    """A JSON value that is not a valid State Event; the message says why."""


class _Missing:
    """``value`` absent from a change event (different from ``null``)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    type: str
    key: str
    operation: Operation
    value: Any = MISSING
    old_value: Any = MISSING
    txid: str | None = None
    timestamp: str | None = None
    # Any other header, kept as sent.
    extra_headers: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, slots=True)
class ControlEvent:
    control: Control
    offset: str | None = None


StateEvent = ChangeEvent | ControlEvent


def is_change_event(event: object) -> TypeGuard[ChangeEvent]:
    """True for a Change Event, parsed or raw (a dict whose headers carry ``operation``)."""
    if isinstance(event, ChangeEvent):
        return True
    return (
        isinstance(event, dict)
        and isinstance(event.get("headers"), dict)
        and ("operation" in event["headers"])
    )


def is_control_event(event: object) -> TypeGuard[ControlEvent]:
    """True for a Control Event, parsed or raw (a dict whose headers carry ``control``)."""
    if isinstance(event, ControlEvent):
        return True
    return (
        isinstance(event, dict)
        and isinstance(event.get("headers"), dict)
        and ("control" in event["headers"])
    )


def _optional_string(headers: dict[str, Any], name: str) -> str | None:
    value = headers.get(name)
    if value is None and name not in headers:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidEvent(f"headers.{name} must be a non-empty string")
    return value


def _timestamp(headers: dict[str, Any]) -> str | None:
    value = _optional_string(headers, "timestamp")
    if value is None:
        return None
    if not _RFC3339.fullmatch(value):
        raise InvalidEvent("headers.timestamp must be an RFC 3339 timestamp")
    # RFC 3339 allows a leap second (:60), which datetime cannot represent: check it as :59.
    candidate = _LEAP_SECOND.sub(r"\1:59", value.upper().replace(" ", "T"))
    try:
        datetime.fromisoformat(candidate)
    except ValueError:
        raise InvalidEvent("headers.timestamp is not a valid date and time") from None
    return value


def parse_event(raw: Any) -> StateEvent:
    """Validate a decoded JSON value as a State Event (STATE-PROTOCOL.md 4-5)."""
    if not isinstance(raw, dict):
        raise InvalidEvent("a state event must be a JSON object")
    headers = raw.get("headers")
    if not isinstance(headers, dict):
        raise InvalidEvent("headers must be an object")
    has_operation = "operation" in headers
    has_control = "control" in headers
    if has_operation and has_control:
        raise InvalidEvent("headers must carry either operation or control, not both")
    if has_control:
        return _control(headers)
    if has_operation:
        return _change(raw, headers)
    raise InvalidEvent("headers must carry operation (a change) or control (a control event)")


def _control(headers: dict[str, Any]) -> ControlEvent:
    control = headers["control"]
    if control not in CONTROLS:
        raise InvalidEvent(f"headers.control must be one of {', '.join(CONTROLS)}")
    offset = _optional_string(headers, "offset")
    if offset is not None and _OFFSET_FORBIDDEN.search(offset):
        raise InvalidEvent("headers.offset is not a valid stream offset")
    return ControlEvent(control=control, offset=offset)


def _change(raw: dict[str, Any], headers: dict[str, Any]) -> ChangeEvent:
    operation = headers["operation"]
    if operation not in CHANGE_OPERATIONS:
        raise InvalidEvent(f"headers.operation must be one of {', '.join(CHANGE_OPERATIONS)}")
    for name in ("type", "key"):
        if not isinstance(raw.get(name), str) or not raw[name]:
            raise InvalidEvent(f"{name} must be a non-empty string")
    if operation != "delete" and "value" not in raw:
        raise InvalidEvent(f"an {operation} must carry a value")
    known = {"operation", "txid", "timestamp"}
    return ChangeEvent(
        type=raw["type"],
        key=raw["key"],
        operation=operation,
        value=raw.get("value", MISSING),
        old_value=raw.get("old_value", MISSING),
        txid=_optional_string(headers, "txid"),
        timestamp=_timestamp(headers),
        extra_headers={k: v for k, v in headers.items() if k not in known},
    )
