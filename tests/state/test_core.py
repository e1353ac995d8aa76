"""The pure State Protocol layer (``state.core``): parsing, type guards and ``MaterializedState``.

No server and no database. Valid event sequences come from hypothesis strategies and are checked
against a reference model written here from the spec's own rules (state-protocol-0.1.md 5.2,
5.3): per ``(type, key)`` the last change wins, a delete removes, a ``reset`` clears what came
before it, other control events change nothing. Invalid events are listed one fault at a time;
each must raise ``InvalidEvent`` naming the fault and leave the state exactly as it was.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from state.core import (
    CHANGE_OPERATIONS,
    CONTROLS,
    ChangeEvent,
    ControlEvent,
    InvalidEvent,
    MaterializedState,
    is_change_event,
    is_control_event,
    parse_event,
)
from state.core.schemas import compile_schemas, judge
from tests.conftest import ROOT
from tests.state.support import model

# -- strategies ------------------------------------------------------------------------------

TYPES = ["user", "message", "flag", "été"]
KEYS = ["1", "2", "user:123", "ключ"]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
timestamps = st.sampled_from(
    [
        "2025-01-15T10:30:00Z",
        "2025-01-15T10:30:00.123456+02:00",
        "2025-01-15t10:30:00z",
        "2025-01-15 10:30:00-05:30",
        "1999-12-31T23:59:59.5Z",
    ]
)
offsets = st.sampled_from(["123456_000", "0000000000000001_0000000000000042", "-1", "now", "x"])


@st.composite
def change_events(draw: st.DrawFn) -> dict[str, Any]:
    operation = draw(st.sampled_from(CHANGE_OPERATIONS))
    headers: dict[str, Any] = {"operation": operation}
    if draw(st.booleans()):
        headers["txid"] = draw(st.text(min_size=1, max_size=6))
    if draw(st.booleans()):
        headers["timestamp"] = draw(timestamps)
    event: dict[str, Any] = {
        "type": draw(st.sampled_from(TYPES)),
        "key": draw(st.sampled_from(KEYS)),
        "headers": headers,
    }
    # 4.1.3: a delete MAY carry a value (ignored) or omit it; insert/update MUST carry one.
    if operation != "delete" or draw(st.booleans()):
        event["value"] = draw(json_values)
    if draw(st.booleans()):
        event["old_value"] = draw(json_values)
    return event


@st.composite
def control_events(draw: st.DrawFn, controls: tuple[str, ...] = CONTROLS) -> dict[str, Any]:
    headers: dict[str, Any] = {"control": draw(st.sampled_from(controls))}
    if draw(st.booleans()):
        headers["offset"] = draw(offsets)
    return {"headers": headers}


NON_RESET = tuple(c for c in CONTROLS if c != "reset")
state_events = st.one_of(change_events(), change_events(), change_events(), control_events())
event_lists = st.lists(state_events, max_size=30)
change_lists = st.lists(change_events(), max_size=20)


def as_dict(state: MaterializedState) -> dict[tuple[str, str], Any]:
    return {(type_name, key): value for type_name, key, value in state.items()}


def snapshot(state: MaterializedState) -> list[tuple[str, str, Any]]:
    return copy.deepcopy(list(state.items()))


def applied(events: list[Any]) -> MaterializedState:
    state = MaterializedState()
    for event in events:
        state.apply(event)
    return state


# -- materialization ------------------------------------------------------------------------


@given(event_lists)
def test_apply_batch_equals_sequential_apply(events: list[dict[str, Any]]) -> None:
    """state-protocol-0.1.md 6.2: applyBatch(events) is apply() on each event in order."""
    batch = MaterializedState()
    batch.apply_batch(events)
    sequential = applied(events)
    assert batch == sequential
    assert list(batch.items()) == list(sequential.items())


@given(event_lists)
def test_state_matches_the_spec_rules(events: list[dict[str, Any]]) -> None:
    """state-protocol-0.1.md 5.2 (insert/update set, delete removes, later events win per
    (type, key)) and 5.3 (reset clears, other control events change nothing)."""
    state = MaterializedState()
    state.apply_batch(events)
    expected = model(events)
    assert as_dict(state) == expected
    assert len(state) == len(expected)
    for (type_name, key), value in expected.items():
        assert state.has(type_name, key)
        assert state.get(type_name, key) == value


@given(change_lists, st.sampled_from(TYPES), st.sampled_from(KEYS), json_values, json_values)
def test_later_event_wins_per_type_and_key(
    events: list[dict[str, Any]], type_name: str, key: str, first: Any, last: Any
) -> None:
    """state-protocol-0.1.md 4.1 rule 4: for a given (type, key) later events override earlier
    ones, whatever came between for other entities; insert and update are both "set" (5.2)."""
    others = [e for e in events if (e["type"], e["key"]) != (type_name, key)]
    state = MaterializedState()
    state.apply({"type": type_name, "key": key, "value": first, "headers": {"operation": "insert"}})
    state.apply_batch(others)
    state.apply({"type": type_name, "key": key, "value": last, "headers": {"operation": "update"}})
    assert state.get(type_name, key) == last
    # Every other entity is exactly what the other events made it.
    rest = as_dict(state)
    del rest[(type_name, key)]
    assert rest == model(others)


@given(change_lists, st.sampled_from(TYPES), st.sampled_from(KEYS), st.booleans())
def test_delete_removes_the_entity(
    events: list[dict[str, Any]], type_name: str, key: str, with_value: bool
) -> None:
    """state-protocol-0.1.md 5.2 (delete: State'(t, k) = ⊥, others unchanged) and 4.1 rule 2
    (a delete's value, if any, is ignored)."""
    state = MaterializedState()
    state.apply_batch(events)
    state.apply({"type": type_name, "key": key, "value": {}, "headers": {"operation": "insert"}})
    before = as_dict(state)
    delete: dict[str, Any] = {"type": type_name, "key": key, "headers": {"operation": "delete"}}
    if with_value:
        delete["value"] = {"ignored": True}
    state.apply(delete)
    assert not state.has(type_name, key)
    assert state.get(type_name, key) is None
    assert key not in state.get_type(type_name)
    del before[(type_name, key)]
    assert as_dict(state) == before


@given(event_lists, event_lists)
def test_reset_starts_a_new_epoch(
    before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> None:
    """state-protocol-0.1.md 4.2 rule 4 and 6 (Control Event Handling): a reset applies to every
    event before it; the events after it materialize as if they were the whole stream."""
    state = MaterializedState()
    state.apply_batch([*before, {"headers": {"control": "reset"}}])
    assert len(state) == 0
    assert state.types == []
    state.apply_batch(after)
    assert state == applied(after)


@given(event_lists, control_events(NON_RESET), st.integers(min_value=0))
def test_non_reset_control_events_change_nothing(
    events: list[dict[str, Any]], control: dict[str, Any], position: int
) -> None:
    """state-protocol-0.1.md 5.3: snapshot-start, snapshot-end and up-to-date have no direct
    effect on the state, wherever they appear."""
    index = position % (len(events) + 1)
    with_control = [*events[:index], control, *events[index:]]
    assert applied(with_control) == applied(events)
    state = applied(events)
    before = snapshot(state)
    state.apply(control)
    assert list(state.items()) == before


def test_snapshot_end_without_start_is_processed() -> None:
    """state-protocol-0.1.md 4.2 rule 2: a snapshot-end without a matching snapshot-start does
    not stop processing."""
    state = MaterializedState()
    state.apply_batch(
        [
            {"headers": {"control": "snapshot-end"}},
            {"type": "user", "key": "1", "value": "a", "headers": {"operation": "insert"}},
            {"headers": {"control": "snapshot-start", "offset": "5_0"}},
            {"headers": {"control": "snapshot-start"}},
            {"headers": {"control": "up-to-date"}},
        ]
    )
    assert list(state.items()) == [("user", "1", "a")]


def test_spec_example_materialization() -> None:
    """STATE-PROTOCOL.md 6 (Example Materialization): the three changes give Alice Smith and
    Bob."""
    state = MaterializedState()
    state.apply_batch(
        [
            {
                "type": "user",
                "key": "1",
                "value": {"name": "Alice"},
                "headers": {"operation": "insert"},
            },
            {
                "type": "user",
                "key": "2",
                "value": {"name": "Bob"},
                "headers": {"operation": "insert"},
            },
            {
                "type": "user",
                "key": "1",
                "value": {"name": "Alice Smith"},
                "headers": {"operation": "update"},
            },
        ]
    )
    assert dict(state.get_type("user")) == {"1": {"name": "Alice Smith"}, "2": {"name": "Bob"}}


def test_old_value_and_headers_do_not_affect_state() -> None:
    """state-protocol-0.1.md 4.1 rules 3 and 6: old_value, timestamp and txid are advisory;
    the order of events, not their timestamps, decides."""
    state = MaterializedState()
    state.apply(
        {
            "type": "t",
            "key": "k",
            "value": 2,
            "old_value": 99,
            "headers": {"operation": "update", "timestamp": "2030-01-01T00:00:00Z", "txid": "b"},
        }
    )
    state.apply(
        {
            "type": "t",
            "key": "k",
            "value": 1,
            "old_value": "wrong",
            "headers": {"operation": "insert", "timestamp": "2000-01-01T00:00:00Z", "txid": "a"},
        }
    )
    assert state.get("t", "k") == 1


@given(event_lists)
def test_parsed_and_raw_events_materialize_alike(events: list[dict[str, Any]]) -> None:
    """state-protocol-0.1.md 6.1: apply accepts a parsed event or its JSON object alike."""
    assert applied([parse_event(e) for e in events]) == applied(events)


# -- invalid events ---------------------------------------------------------------------------


def change(**overrides: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "user",
        "key": "1",
        "value": {"a": 1},
        "headers": {"operation": "insert"},
    }
    for name, value in overrides.items():
        if value is _DROP:
            event.pop(name)
        else:
            event[name] = value
    return event


def change_headers(**headers: Any) -> dict[str, Any]:
    return change(headers={"operation": "insert", **headers})


_DROP = object()

# (raw event, a phrase the error message must contain)
INVALID_EVENTS = [
    pytest.param([], "must be a JSON object", id="array"),
    pytest.param("insert", "must be a JSON object", id="string"),
    pytest.param(42, "must be a JSON object", id="number"),
    pytest.param(None, "must be a JSON object", id="null"),
    pytest.param(change(headers=_DROP), "headers must be an object", id="missing-headers"),
    pytest.param(change(headers=None), "headers must be an object", id="null-headers"),
    pytest.param(change(headers=["operation"]), "headers must be an object", id="array-headers"),
    pytest.param(change(headers={}), "must carry operation", id="empty-headers"),
    pytest.param(change(headers={"txid": "x"}), "must carry operation", id="no-discriminant"),
    pytest.param(
        change(headers={"operation": "insert", "control": "reset"}),
        "not both",
        id="operation-and-control",
    ),
    pytest.param(
        change(headers={"operation": "upsert"}),
        "headers.operation must be one of",
        id="unknown-operation",
    ),
    pytest.param(
        change(headers={"operation": "INSERT"}),
        "headers.operation must be one of",
        id="operation-case",
    ),
    pytest.param(
        change(headers={"operation": None}), "headers.operation must be one of", id="null-operation"
    ),
    pytest.param(
        {"headers": {"control": "rewind"}}, "headers.control must be one of", id="unknown-control"
    ),
    pytest.param(
        {"headers": {"control": 1}}, "headers.control must be one of", id="numeric-control"
    ),
    pytest.param(change(type=_DROP), "type must be a non-empty string", id="missing-type"),
    pytest.param(change(type=""), "type must be a non-empty string", id="empty-type"),
    pytest.param(change(type=7), "type must be a non-empty string", id="numeric-type"),
    pytest.param(change(key=_DROP), "key must be a non-empty string", id="missing-key"),
    pytest.param(change(key=""), "key must be a non-empty string", id="empty-key"),
    pytest.param(change(key=123), "key must be a non-empty string", id="numeric-key"),
    pytest.param(change(key=["1"]), "key must be a non-empty string", id="array-key"),
    pytest.param(change(key=None), "key must be a non-empty string", id="null-key"),
    pytest.param(change(value=_DROP), "insert must carry a value", id="insert-without-value"),
    pytest.param(
        change(value=_DROP, headers={"operation": "update"}),
        "update must carry a value",
        id="update-without-value",
    ),
    pytest.param(
        change_headers(txid=""), "headers.txid must be a non-empty string", id="empty-txid"
    ),
    pytest.param(
        change_headers(txid=17), "headers.txid must be a non-empty string", id="numeric-txid"
    ),
    pytest.param(
        change_headers(txid=None), "headers.txid must be a non-empty string", id="null-txid"
    ),
    pytest.param(change_headers(timestamp="2025-01-15"), "RFC 3339", id="date-only"),
    pytest.param(change_headers(timestamp="2025-01-15T10:30:00"), "RFC 3339", id="no-zone"),
    pytest.param(change_headers(timestamp="15 Jan 2025 10:30 GMT"), "RFC 3339", id="rfc2822"),
    pytest.param(
        change_headers(timestamp="2025-01-15T10:30:00+0200"), "RFC 3339", id="zone-without-colon"
    ),
    pytest.param(change_headers(timestamp="2025-02-30T00:00:00Z"), "timestamp", id="february-30"),
    pytest.param(change_headers(timestamp="2025-01-15T25:00:00Z"), "timestamp", id="hour-25"),
    pytest.param(
        change_headers(timestamp=""),
        "headers.timestamp must be a non-empty string",
        id="empty-timestamp",
    ),
    pytest.param(change_headers(timestamp=1736937000), "headers.timestamp", id="epoch-number"),
    pytest.param(
        {"headers": {"control": "reset", "offset": ""}},
        "headers.offset must be a non-empty string",
        id="empty-offset",
    ),
    pytest.param(
        {"headers": {"control": "reset", "offset": 5}},
        "headers.offset must be a non-empty string",
        id="numeric-offset",
    ),
    pytest.param(
        {"headers": {"control": "snapshot-start", "offset": "1,2"}},
        "not a valid stream offset",
        id="offset-comma",
    ),
    pytest.param(
        {"headers": {"control": "snapshot-end", "offset": "a/b"}},
        "not a valid stream offset",
        id="offset-slash",
    ),
    pytest.param(
        {"headers": {"control": "up-to-date", "offset": "x=1&y"}},
        "not a valid stream offset",
        id="offset-query",
    ),
]


def populated() -> MaterializedState:
    state = MaterializedState()
    state.apply_batch(
        [
            {"type": "user", "key": "1", "value": {"n": 1}, "headers": {"operation": "insert"}},
            {"type": "user", "key": "2", "value": None, "headers": {"operation": "insert"}},
            {"type": "flag", "key": "x", "value": True, "headers": {"operation": "insert"}},
        ]
    )
    return state


@pytest.mark.parametrize(("raw", "phrase"), INVALID_EVENTS)
def test_invalid_event_is_rejected_and_changes_nothing(raw: Any, phrase: str) -> None:
    """STATE-PROTOCOL.md 4.1, 4.2, 5.1, 5.2 (required fields and their types) and 9.1
    (malformed messages are rejected): InvalidEvent with a message naming the fault; the
    state is untouched."""
    with pytest.raises(InvalidEvent) as parsed:
        parse_event(raw)
    assert phrase in str(parsed.value)
    assert isinstance(parsed.value, ValueError)

    state = populated()
    before = snapshot(state)
    with pytest.raises(InvalidEvent) as applied_error:
        state.apply(raw)
    assert str(applied_error.value) == str(parsed.value)
    assert list(state.items()) == before


@given(
    event_lists,
    st.sampled_from([p.values[0] for p in INVALID_EVENTS]),
    event_lists,
    event_lists,
)
@settings(max_examples=200)
def test_apply_batch_is_all_or_nothing(
    history: list[dict[str, Any]],
    invalid: Any,
    prefix: list[dict[str, Any]],
    suffix: list[dict[str, Any]],
) -> None:
    """state-protocol-0.1.md 7 rule 3 (a consumer must not corrupt its state on invalid
    input): a batch with one invalid event anywhere raises before applying any of it, even a
    reset earlier in the batch."""
    state = MaterializedState()
    state.apply_batch(history)
    before = snapshot(state)
    with pytest.raises(InvalidEvent):
        state.apply_batch([*prefix, {"headers": {"control": "reset"}}, invalid, *suffix])
    assert list(state.items()) == before
    # The same batch without the invalid event applies normally.
    state.apply_batch([*prefix, *suffix])
    assert as_dict(state) == model([*history, *prefix, *suffix])


def test_apply_batch_reports_the_first_invalid_event() -> None:
    """state-protocol-0.1.md 6.2: the batch fails on its first invalid event, as sequential
    apply would."""
    state = populated()
    with pytest.raises(InvalidEvent, match="type must be a non-empty string"):
        state.apply_batch(
            [
                {"type": "user", "key": "9", "value": 9, "headers": {"operation": "insert"}},
                change(type=""),
                change(headers={"operation": "upsert"}),
            ]
        )
    assert not state.has("user", "9")


@given(json_values)
@settings(max_examples=300)
def test_parse_event_accepts_or_raises_invalid_event(raw: Any) -> None:
    """STATE-PROTOCOL.md 9.3 (stream contents are untrusted): any JSON value is either a State
    Event or an InvalidEvent, never another exception."""
    try:
        event = parse_event(raw)
    except InvalidEvent as exc:
        assert str(exc)
    else:
        assert isinstance(event, ChangeEvent | ControlEvent)


@given(
    st.dictionaries(st.sampled_from(["type", "key", "value", "old_value", "headers"]), json_values)
)
@settings(max_examples=300)
def test_parse_event_on_near_events(raw: dict[str, Any]) -> None:
    """STATE-PROTOCOL.md 9.1: objects shaped almost like events are parsed or rejected with
    InvalidEvent, never a crash."""
    for headers in ({"operation": "insert"}, {"control": "reset"}, raw.get("headers")):
        candidate = {**raw, "headers": headers}
        try:
            parse_event(candidate)
        except InvalidEvent as exc:
            assert str(exc)


# -- valid edge cases ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timestamp",
    [
        "2025-01-15T10:30:00Z",
        "2025-01-15T10:30:00.5Z",
        "2025-01-15T10:30:00.123456789+05:30",
        "2025-01-15t10:30:00z",
        "2025-01-15 10:30:00-00:00",
        "2024-02-29T23:59:59+14:00",
    ],
)
def test_rfc3339_timestamps_are_accepted(timestamp: str) -> None:
    """STATE-PROTOCOL.md 5.1: headers.timestamp MAY be present and is an RFC 3339 timestamp
    (RFC 3339 5.6: fractional seconds, lowercase t/z, space separator per its note)."""
    event = parse_event(change_headers(timestamp=timestamp))
    assert isinstance(event, ChangeEvent)
    assert event.timestamp == timestamp


def test_parsed_change_event_fields() -> None:
    """state-protocol-0.1.md 4.1: the canonical envelope, headers kept (unknown ones too)."""
    raw = {
        "type": "user",
        "key": "user:123",
        "value": {"name": "Alice"},
        "old_value": None,
        "headers": {
            "operation": "update",
            "txid": "tx-1",
            "timestamp": "2025-01-15T10:35:00Z",
            "origin": "test",
        },
    }
    event = parse_event(raw)
    assert isinstance(event, ChangeEvent)
    assert (event.type, event.key, event.operation) == ("user", "user:123", "update")
    assert event.value == {"name": "Alice"}
    assert event.old_value is None
    assert (event.txid, event.timestamp) == ("tx-1", "2025-01-15T10:35:00Z")
    assert event.extra_headers == {"origin": "test"}


@pytest.mark.parametrize("control", CONTROLS)
def test_parsed_control_event_fields(control: str) -> None:
    """state-protocol-0.1.md 4.2: the four control kinds, with an optional offset."""
    event = parse_event({"headers": {"control": control, "offset": "123456_789"}})
    assert event == ControlEvent(control=control, offset="123456_789")  # type: ignore[arg-type]
    assert parse_event({"headers": {"control": control}}) == ControlEvent(control=control)  # type: ignore[arg-type]


def test_delete_without_value_and_null_values() -> None:
    """STATE-PROTOCOL.md 4.1.3 (delete MAY omit value) and 5.1 (value is any JSON value, null
    included): a null value is an entity, distinct from no entity."""
    state = MaterializedState()
    state.apply({"type": "t", "key": "k", "value": None, "headers": {"operation": "insert"}})
    assert state.has("t", "k")
    assert state.get("t", "k") is None
    assert list(state.items()) == [("t", "k", None)]
    state.apply({"type": "t", "key": "k", "headers": {"operation": "delete"}})
    assert not state.has("t", "k")
    assert len(state) == 0
    # Deleting what does not exist is allowed (5.2 note) and changes nothing.
    state.apply({"type": "t", "key": "never", "headers": {"operation": "delete"}})
    assert len(state) == 0


# -- type guards -----------------------------------------------------------------------------


@given(state_events)
def test_type_guards_on_raw_and_parsed_events(raw: dict[str, Any]) -> None:
    """state-protocol-0.1.md 4.2 (Discriminant): headers.operation makes a ChangeEvent,
    headers.control a ControlEvent; the guards agree with parse_event."""
    parsed = parse_event(raw)
    is_change = "operation" in raw["headers"]
    assert is_change_event(raw) is is_change
    assert is_control_event(raw) is not is_change
    assert is_change_event(parsed) is is_change
    assert is_control_event(parsed) is not is_change
    assert isinstance(parsed, ChangeEvent if is_change else ControlEvent)


@pytest.mark.parametrize(
    "value",
    [
        None,
        1,
        "headers",
        [],
        {},
        {"headers": None},
        {"headers": ["operation"]},
        {"headers": "operation control"},
        {"type": "t", "key": "k", "operation": "insert"},
    ],
)
def test_type_guards_reject_non_events(value: Any) -> None:
    """state-protocol-0.1.md 4.2: neither guard holds without a headers object carrying the
    discriminant."""
    assert is_change_event(value) is False
    assert is_control_event(value) is False


# -- reading the state -----------------------------------------------------------------------


def test_get_get_type_types_and_type_count() -> None:
    """state-protocol-0.1.md 6.3, 6.4 and the optional helpers (clear, types, type counts)."""
    state = MaterializedState()
    assert state.get("user", "1") is None
    assert dict(state.get_type("user")) == {}
    assert (state.types, state.type_count("user"), len(state)) == ([], 0, 0)

    state.apply_batch(
        [
            {"type": "user", "key": "b", "value": {"n": 2}, "headers": {"operation": "insert"}},
            {"type": "user", "key": "a", "value": {"n": 1}, "headers": {"operation": "insert"}},
            {"type": "message", "key": "m1", "value": "hi", "headers": {"operation": "insert"}},
            {"type": "flag", "key": "f", "value": False, "headers": {"operation": "insert"}},
        ]
    )
    assert state.get("user", "a") == {"n": 1}
    assert state.get("user", "m1") is None  # keys are per type
    assert state.get("message", "m1") == "hi"
    assert state.get("flag", "f") is False
    users = state.get_type("user")
    assert dict(users) == {"a": {"n": 1}, "b": {"n": 2}}
    with pytest.raises(TypeError):
        users["c"] = 3  # type: ignore[index]  # a read-only view
    assert state.types == ["flag", "message", "user"]
    assert [state.type_count(t) for t in ("flag", "message", "user", "none")] == [1, 1, 2, 0]
    assert list(state.items()) == [
        ("flag", "f", False),
        ("message", "m1", "hi"),
        ("user", "a", {"n": 1}),
        ("user", "b", {"n": 2}),
    ]

    # A type whose last entity is deleted is no longer listed.
    state.apply({"type": "message", "key": "m1", "headers": {"operation": "delete"}})
    assert state.types == ["flag", "user"]
    assert state.type_count("message") == 0

    state.clear()
    assert (state.types, len(state), state.get("user", "a")) == ([], 0, None)


def test_states_compare_by_content() -> None:
    """state-protocol-0.1.md 5.1: two states are equal when they map the same (type, key) to the
    same value, however they got there."""
    first = MaterializedState()
    first.apply_batch(
        [
            {"type": "t", "key": "k", "value": 1, "headers": {"operation": "insert"}},
            {"type": "t", "key": "k", "value": 2, "headers": {"operation": "update"}},
        ]
    )
    second = MaterializedState()
    second.apply({"type": "t", "key": "k", "value": 2, "headers": {"operation": "insert"}})
    assert first == second
    second.apply({"type": "t", "key": "k", "value": 3, "headers": {"operation": "update"}})
    assert first != second


# -- no Django -------------------------------------------------------------------------------


def test_core_imports_no_django() -> None:
    """STYLE.md (wire rules are pure modules): state.core runs in a plain Python process with no
    Django settings and imports nothing of Django."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    code = (
        "import sys\n"
        "import state.core, state.core.events, state.core.materialized\n"
        "s = state.core.MaterializedState()\n"
        "s.apply({'type': 't', 'key': 'k', 'value': 1, 'headers': {'operation': 'insert'}})\n"
        "assert s.get('t', 'k') == 1\n"
        "loaded = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'))\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "message",
    [
        b'{"type": "user", "key": "1", "value": "a\\u0000b", "headers": {"operation": "insert"}}',
        b'{"headers": {"control": "reset", "note": "\\u0000"}}',  # a control event too
        b'{"headers": {"control": "reset", "note": "\\ud800"}}',
    ],
)
def test_judge_refuses_what_postgresql_cannot_store(message: bytes) -> None:
    """Both materializers (in-process and Spark) judge through ``judge``: an event jsonb
    cannot hold is invalid, whatever its kind, as it is for the SQL materializer."""
    event, reason = judge(message, {})
    assert event is None and reason is not None and "NUL" in reason


def test_judge_parses_valid_events_and_explains_the_rest() -> None:
    event, reason = judge(b'{"headers": {"control": "reset"}}', {})
    assert isinstance(event, ControlEvent) and reason is None
    event, reason = judge(b"not json", {})
    assert event is None and reason
    validators = compile_schemas({"user": {"type": "object", "required": ["name"]}})
    event, reason = judge(
        b'{"type": "user", "key": "1", "value": {}, "headers": {"operation": "insert"}}', validators
    )
    assert event is None and "does not match its schema" in str(reason)
