"""The state app against the real server over HTTP: registration of state streams, backfill,
read-your-writes, validation of appends, reset, unregistering and deleting, pagination, the
OpenAPI schema and the ``__registry__`` stream.

Sections cited: STATE-PROTOCOL.md (the message format, 4-7, 9) and state-protocol-0.1.md (event
model and materialization, 4-6). The server-side API itself (/v1/state/..., /v1/streams) is this
project's own (state/api/views.py, streams/api.py); tests of it name the view's contract.
Every test uses streams of its own, and the shared database may hold other streams, so checks
on the registry are limited to this test's streams.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from datetime import datetime
from typing import Any

import httpx
import psycopg
import pytest

from state.core import InvalidEvent, parse_event
from tests.conftest import ServerProcess
from tests.state.support import (
    JSON,
    REGISTRY,
    STATE,
    USER_SCHEMA,
    append,
    append_ok,
    change,
    control,
    create_json_stream,
    entities,
    entity_map,
    model,
    read_messages,
    register,
    register_ok,
    registration,
    stream_id,
    stream_url,
    tail,
    walk_pages,
)

SCHEMAS = {"user": USER_SCHEMA}


def state_of(client: httpx.Client, path: str) -> tuple[str, list[Any], list[dict[str, Any]]]:
    """Everything an append may change: the tail, the messages and the entities."""
    return tail(client, path), read_messages(client, path)[0], entities(client, path)


# -- registration ----------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8"])
def test_register_a_json_stream(client: httpx.Client, stream_path: str, content_type: str) -> None:
    """STATE-PROTOCOL.md 3 (state streams are application/json streams); POST /v1/state/streams:
    201 with the registration, listed and readable afterwards."""
    response = client.put(stream_url(stream_path), headers={"Content-Type": content_type})
    assert response.status_code == 201
    body = register_ok(client, stream_path, SCHEMAS)
    assert body["stream"] == stream_path
    assert body["schemas"] == SCHEMAS
    assert body["materialized_offset"] == tail(client, stream_path)
    assert (body["invalid_events"], body["last_error"]) == (0, "")
    datetime.fromisoformat(body["created_at"].replace("Z", "+00:00"))

    detail = registration(client, stream_path)
    assert detail.status_code == 200
    assert detail.json() == body
    listed = walk_pages(client, f"{STATE}/streams", {"page_size": 1000})
    assert [r for r in listed if r["stream"] == stream_path] == [body]
    assert entities(client, stream_path) == []


def test_register_again(client: httpx.Client, stream_path: str) -> None:
    """POST /v1/state/streams: the same registration again is 200 and changes nothing; other
    schemas are 409 and keep the first registration."""
    create_json_stream(client, stream_path, [change("user", "1", {"name": "a"})])
    first = register_ok(client, stream_path, SCHEMAS)

    again = register(client, stream_path, SCHEMAS)
    assert again.status_code == 200, again.text
    assert again.json() == first

    for other in ({}, {"user": {"type": "object"}}, {**SCHEMAS, "message": {"type": "string"}}):
        conflict = register(client, stream_path, other)
        assert conflict.status_code == 409, conflict.text
        assert "other schemas" in conflict.json()["detail"]
    assert registration(client, stream_path).json()["schemas"] == SCHEMAS
    # The schemas still apply: the first registration is the one in force.
    assert append(client, stream_path, [change("user", "2", {"name": 2})]).status_code == 400


def test_register_unknown_stream(client: httpx.Client, stream_path: str) -> None:
    """POST /v1/state/streams: a stream that does not exist is 404, and nothing is registered."""
    response = register(client, stream_path, SCHEMAS)
    assert response.status_code == 404, response.text
    assert registration(client, stream_path).status_code == 404


@pytest.mark.parametrize("content_type", ["text/plain", "application/octet-stream"])
def test_register_non_json_stream(
    client: httpx.Client, stream_path: str, content_type: str
) -> None:
    """STATE-PROTOCOL.md 3: state streams are application/json; registering another stream is
    409 and leaves it a plain stream."""
    response = client.put(
        stream_url(stream_path), headers={"Content-Type": content_type}, content=b"x"
    )
    assert response.status_code == 201
    response = register(client, stream_path)
    assert response.status_code == 409, response.text
    assert content_type in response.json()["detail"]
    assert registration(client, stream_path).status_code == 404
    assert client.post(
        stream_url(stream_path), headers={"Content-Type": content_type}, content=b"y"
    ).status_code in (200, 204)


@pytest.mark.parametrize(
    "payload",
    [
        {"schemas": {"user": {"type": 12}}},
        {"schemas": {"user": {"type": "object", "required": "name"}}},
        {"schemas": {"user": {"minimum": "zero"}}},
        {"schemas": {"user": {"properties": {"name": {"pattern": "("}}}}},
        {"schemas": "not an object"},
        {"schemas": ["user"]},
        {"stream": None},
        {"stream": ""},
    ],
)
def test_register_with_invalid_request(
    client: httpx.Client, stream_path: str, payload: dict[str, Any]
) -> None:
    """STATE-PROTOCOL.md 7 (schema validation): a schema that is not a valid JSON Schema, or a
    malformed request, is 400 and registers nothing."""
    create_json_stream(client, stream_path)
    response = client.post(f"{STATE}/streams", json={"stream": stream_path, **payload})
    assert response.status_code == 400, response.text
    assert registration(client, stream_path).status_code == 404
    assert append(client, stream_path, [{"any": "json"}]).status_code in (200, 204)


# -- backfill --------------------------------------------------------------------------------


def test_registration_backfills_history(client: httpx.Client, stream_path: str) -> None:
    """state-protocol-0.1.md 5 (materialization of a stream's whole history) on registration;
    events that are not valid State Events or fail the schema are skipped and counted
    (STATE-PROTOCOL.md 7: invalid messages MAY be rejected or logged; 9.1)."""
    valid_then = [
        change("user", "1", {"name": "Ann"}),
        change("user", "2", {"name": "Bob", "age": 3}, txid="t1", timestamp="2025-01-15T10:30:00Z"),
        change("message", "m1", "hello"),
        change("message", "m2", ["any", {"json": True}], op="update"),
        control("snapshot-start", offset="0_0"),
        change("user", "1", {"name": "Ann B"}, op="update"),
        control("snapshot-end"),
        change("message", "m1", op="delete"),
    ]
    invalid = [
        (42, "a state event must be a JSON object"),
        ({"type": "user", "key": "3", "value": {"name": "x"}}, "headers must be an object"),
        (change("user", "4", {"name": "x"}, op="upsert"), "headers.operation must be one of"),
        (change("user", "5", {"name": 5}), "does not match its schema"),
        (
            {"type": "user", "key": "", "value": {"name": "x"}, "headers": {"operation": "insert"}},
            "key must be a non-empty string",
        ),
    ]
    history = [
        valid_then[0],
        invalid[0][0],
        *valid_then[1:4],
        invalid[1][0],
        invalid[2][0],
        *valid_then[4:],
        invalid[3][0],
        invalid[4][0],
    ]
    create_json_stream(client, stream_path, history[:5])
    append_ok(client, stream_path, history[5:-1])
    last_offset = tail(client, stream_path)
    append_ok(client, stream_path, history[-1:])
    end = tail(client, stream_path)

    body = register_ok(client, stream_path, SCHEMAS)
    assert body["materialized_offset"] == end
    assert body["invalid_events"] == len(invalid)
    # The last skipped event is named, with its offset (it is the last message).
    assert body["last_error"].startswith(f"event at offset {last_offset}: ")
    assert invalid[-1][1] in body["last_error"]

    found = entities(client, stream_path)
    assert {(e["type"], e["key"]): e["value"] for e in found} == model(valid_then)
    assert [(e["type"], e["key"]) for e in found] == sorted((e["type"], e["key"]) for e in found)
    _check_entity_offsets(client, stream_path, found)


def _check_entity_offsets(client: httpx.Client, path: str, found: list[dict[str, Any]]) -> None:
    """Each entity's offset is the position of the event that set it: reading the stream from
    there starts with that event (PROTOCOL.md 5.6)."""
    for entity in found:
        response = client.get(stream_url(path), params={"offset": entity["offset"]})
        assert response.status_code == 200, response.text
        event = response.json()[0]
        assert (event["type"], event["key"], event["value"]) == (
            entity["type"],
            entity["key"],
            entity["value"],
        )
        assert event["headers"]["operation"] in ("insert", "update")


def test_backfill_honours_reset(client: httpx.Client, stream_path: str) -> None:
    """state-protocol-0.1.md 4.2 rule 4: a reset in the history clears what came before it."""
    create_json_stream(
        client,
        stream_path,
        [
            change("user", "1", {"name": "a"}),
            change("user", "2", {"name": "b"}),
            control("reset"),
            change("user", "3", {"name": "c"}),
            change("user", "1", {"name": "a2"}),
        ],
    )
    register_ok(client, stream_path, SCHEMAS)
    assert entity_map(client, stream_path) == {
        ("user", "1"): {"name": "a2"},
        ("user", "3"): {"name": "c"},
    }


# -- read-your-writes ------------------------------------------------------------------------


def test_read_your_writes(client: httpx.Client, stream_path: str) -> None:
    """state-protocol-0.1.md 4.1 rules 1 and 4 on the server: every acknowledged append is at
    once visible in /v1/state/entities, with the offset of the event that set it."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    expected: dict[tuple[str, str], Any] = {}
    before = tail(client, stream_path)
    for i in range(60):
        key = str(i % 7)
        entity_type = "user" if i % 2 else "note"
        if i % 5 == 4:
            event = change(entity_type, key, op="delete")
            expected.pop((entity_type, key), None)
        else:
            value = {"name": f"n{i}", "age": i} if entity_type == "user" else [i, str(i)]
            event = change(entity_type, key, value, op="update" if i % 3 else "insert")
            expected[(entity_type, key)] = value
        after = append_ok(client, stream_path, [event])
        found = entities(client, stream_path, type=entity_type, key=key)
        if (entity_type, key) in expected:
            assert found == [
                {
                    "type": entity_type,
                    "key": key,
                    "value": expected[(entity_type, key)],
                    "offset": before,
                }
            ], i
        else:
            assert found == [], i
        before = after
    assert entity_map(client, stream_path) == expected


def test_read_your_writes_concurrent_writers(server: ServerProcess, stream_path: str) -> None:
    """state-protocol-0.1.md 4.1 rule 4 with several writers at once: each writer sees its own
    acknowledged append immediately; the final state is the model of the stream's order."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        create_json_stream(client, stream_path)
        register_ok(client, stream_path, SCHEMAS)
    failures: list[str] = []

    def writer(n: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            for i in range(12):
                value = {"name": f"w{n}", "age": i}
                append_ok(
                    http,
                    stream_path,
                    [change("user", f"w{n}", value), change("user", "shared", value)],
                )
                mine = entities(http, stream_path, type="user", key=f"w{n}")
                if [e["value"] for e in mine] != [value]:
                    failures.append(f"writer {n} append {i}: saw {mine}")

    # Through futures, so that a writer's failed assertion or error fails the test.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(writer, n) for n in range(8)]:
            future.result(timeout=60)
    assert failures == []
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        messages, _ = read_messages(client, stream_path)
        assert len(messages) == 8 * 12 * 2
        assert entity_map(client, stream_path) == model(messages)


def test_duplicate_producer_append_is_not_applied_twice(
    client: httpx.Client, stream_path: str
) -> None:
    """state-protocol-0.1.md 2.3 and 4.1 rule 5 (exactly once): a retried idempotent-producer
    append (PROTOCOL.md 5.2.1, answered 204 as a duplicate) does not re-apply its events."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    producer = {"Producer-Id": "p1", "Producer-Epoch": "0", "Producer-Seq": "0"}
    body = json.dumps([change("user", "1", {"name": "from producer"})])
    first = client.post(stream_url(stream_path), headers=JSON | producer, content=body)
    assert first.status_code == 200, first.text
    append_ok(client, stream_path, [change("user", "1", {"name": "later"})])
    end = tail(client, stream_path)

    retry = client.post(stream_url(stream_path), headers=JSON | producer, content=body)
    assert retry.status_code == 204, retry.text
    assert tail(client, stream_path) == end
    assert entity_map(client, stream_path) == {("user", "1"): {"name": "later"}}


# -- validation of appends -------------------------------------------------------------------

VALID = [
    change("user", "a", {"name": "A"}),
    change("note", "n", "free text"),
    change("user", "b", {"name": "B", "age": 1}, op="update"),
]

# (invalid event, phrase the 400 must contain)
INVALID = [
    pytest.param(
        change("user", "x", {"age": 1}), '"name" is a required property', id="schema-required"
    ),
    pytest.param(change("user", "x", {"name": "X", "age": -1}), "['age']", id="schema-nested"),
    # Acknowledged, it could never be materialized: the entity index holds about 2.7 KB a row.
    pytest.param(change("note", "k" * 1997, "v"), "at most 2000 bytes", id="identity-too-long"),
    pytest.param(
        change("user", "x", "not an object"), "does not match its schema", id="schema-type"
    ),
    pytest.param(7, "a state event must be a JSON object", id="number"),
    pytest.param(["nested"], "a state event must be a JSON object", id="array-in-array"),
    pytest.param(
        {"type": "user", "key": "x", "value": {"name": "X"}},
        "headers must be an object",
        id="no-headers",
    ),
    pytest.param(
        {
            "headers": {"operation": "insert", "control": "reset"},
            "type": "t",
            "key": "k",
            "value": 1,
        },
        "not both",
        id="operation-and-control",
    ),
    pytest.param(
        change("note", "k", 1, op="upsert"),
        "headers.operation must be one of",
        id="unknown-operation",
    ),
    pytest.param(control("rewind"), "headers.control must be one of", id="unknown-control"),
    pytest.param(change("", "k", 1), "type must be a non-empty string", id="empty-type"),
    pytest.param(change("note", 5, 1), "key must be a non-empty string", id="numeric-key"),
    pytest.param(
        {"type": "note", "key": "k", "headers": {"operation": "insert"}},
        "insert must carry a value",
        id="insert-without-value",
    ),
    pytest.param(change("note", "k", 1, txid=""), "headers.txid", id="empty-txid"),
    pytest.param(change("note", "k", 1, timestamp="yesterday"), "RFC 3339", id="bad-timestamp"),
    pytest.param(control("reset", offset="a,b"), "not a valid stream offset", id="bad-offset"),
]


@pytest.mark.parametrize("position", [0, 2, 3])
@pytest.mark.parametrize(("bad", "reason"), INVALID)
def test_append_with_an_invalid_event_is_refused_whole(
    client: httpx.Client, stream_path: str, bad: Any, reason: str, position: int
) -> None:
    """STATE-PROTOCOL.md 7 and 9.1-9.2 (malformed messages and values failing the schema are
    rejected before materialization): one invalid event among valid ones gets 400 naming its
    index and the reason, and nothing of the append is stored or materialized."""
    create_json_stream(client, stream_path, [change("user", "a", {"name": "before"})])
    register_ok(client, stream_path, SCHEMAS)
    before = state_of(client, stream_path)

    events = [*VALID[:position], bad, *VALID[position:]]
    response = append(client, stream_path, events)
    assert response.status_code == 400, response.text
    assert response.text.startswith(f"event {position}: ")
    assert reason in response.text
    assert state_of(client, stream_path) == before
    # The valid events alone are accepted.
    append_ok(client, stream_path, VALID)
    assert entity_map(client, stream_path)[("user", "a")] == {"name": "A"}


def test_single_invalid_event_body(client: httpx.Client, stream_path: str) -> None:
    """PROTOCOL.md 9.1 (a non-array body is one message) with STATE-PROTOCOL.md 9.1: a lone
    invalid event is event 0."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    before = state_of(client, stream_path)
    response = client.post(stream_url(stream_path), headers=JSON, content=b'{"headers": {}}')
    assert response.status_code == 400
    assert response.text.startswith("event 0: not a valid state event: ")
    assert state_of(client, stream_path) == before


def test_appends_refused_by_the_base_protocol_keep_their_answer(
    client: httpx.Client, stream_path: str
) -> None:
    """PROTOCOL.md 5.2: a registered stream answers a wrong content type and appends after
    close with 409, as any stream does (not a validation failure, which would be 503)."""
    create_json_stream(client, stream_path, [change("user", "1", {"name": "Ada"})])
    register_ok(client, stream_path, SCHEMAS)
    before = read_messages(client, stream_path)
    wrong_type = client.post(
        stream_url(stream_path), headers={"Content-Type": "text/plain"}, content=b"hello"
    )
    assert wrong_type.status_code == 409, wrong_type.text
    closed = client.post(stream_url(stream_path), headers={"Stream-Closed": "true"})
    assert closed.status_code == 204
    after_close = append(client, stream_path, [change("user", "2", {"name": "Bo"})])
    assert after_close.status_code == 409, after_close.text
    assert after_close.headers["Stream-Closed"] == "true"
    assert read_messages(client, stream_path)[0] == before[0]


def test_schemas_apply_per_type_and_not_to_deletes(client: httpx.Client, stream_path: str) -> None:
    """STATE-PROTOCOL.md 7 (validation per entity type; it SHOULD NOT block other types) and
    state-protocol-0.1.md 4.1 rule 2 (a delete's value is ignored): types without a schema take
    any JSON value, and deletes are not checked against the schema."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    anything = [None, 0, -2.5, True, "s", [], {}, [{"deep": [1, {"x": None}]}], "héllo ✓ 😀"]
    events = [change("misc", str(i), v) for i, v in enumerate(anything)]
    events += [
        change("user", "u", {"name": "U"}),
        {**change("user", "u", op="delete"), "value": "not a user"},
        {**change("user", "gone", op="delete"), "old_value": 1},
    ]
    append_ok(client, stream_path, events)
    expected = {("misc", str(i)): v for i, v in enumerate(anything)}
    assert entity_map(client, stream_path) == expected


def test_unregistered_json_stream_takes_any_json(client: httpx.Client, stream_path: str) -> None:
    """STATE-PROTOCOL.md 3: only registered streams are state streams; other JSON streams keep
    the base protocol's JSON mode (PROTOCOL.md 9.1)."""
    create_json_stream(client, stream_path)
    append_ok(client, stream_path, [1, "two", {"headers": "no"}, change("user", "x", 1)])
    assert read_messages(client, stream_path)[0] == [
        1,
        "two",
        {"headers": "no"},
        change("user", "x", 1),
    ]


# -- reset and controls ----------------------------------------------------------------------


def test_reset_clears_state_and_later_events_apply(client: httpx.Client, stream_path: str) -> None:
    """state-protocol-0.1.md 4.2 rule 4 (events after a reset are a new epoch) and 5.3
    (snapshot-start, snapshot-end and up-to-date change nothing), across and within appends."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    append_ok(client, stream_path, [change("user", "1", {"name": "a"}), change("note", "n", 1)])
    append_ok(
        client,
        stream_path,
        [control("snapshot-start", offset="1_1"), control("up-to-date"), control("snapshot-end")],
    )
    assert entity_map(client, stream_path) == {("user", "1"): {"name": "a"}, ("note", "n"): 1}

    append_ok(client, stream_path, [control("reset")])
    assert entities(client, stream_path) == []

    append_ok(client, stream_path, [change("note", "n", 2), change("note", "m", 3)])
    assert entity_map(client, stream_path) == {("note", "n"): 2, ("note", "m"): 3}

    # A reset inside one append: only what follows it survives.
    append_ok(
        client,
        stream_path,
        [
            change("note", "x", 4),
            control("reset"),
            change("note", "m", 5),
            change("user", "2", {"name": "b"}),
        ],
    )
    assert entity_map(client, stream_path) == {("note", "m"): 5, ("user", "2"): {"name": "b"}}

    # A reset at the end of an append clears it all, the append's own changes included.
    append_ok(client, stream_path, [change("note", "y", 6), control("reset", offset="x")])
    assert entities(client, stream_path) == []
    messages, _ = read_messages(client, stream_path)
    assert model(messages) == {}


# -- unregistering ---------------------------------------------------------------------------


def test_unregister_drops_state_and_keeps_stream(client: httpx.Client, stream_path: str) -> None:
    """DELETE /v1/state/streams/<path>: 204; the registration and its entities are gone, the
    stream and its messages stay; registering again rebuilds the state from the history."""
    events = [change("user", "1", {"name": "a"}), change("note", "n", [1])]
    create_json_stream(client, stream_path, events)
    register_ok(client, stream_path, SCHEMAS)
    assert len(entities(client, stream_path)) == 2
    before_tail = tail(client, stream_path)

    assert client.delete(f"{STATE}/streams/{stream_path}").status_code == 204
    assert registration(client, stream_path).status_code == 404
    response = client.get(f"{STATE}/entities", params={"stream": stream_path})
    assert response.status_code == 404, response.text
    listed = walk_pages(client, f"{STATE}/streams", {"page_size": 1000})
    assert stream_path not in [r["stream"] for r in listed]
    assert tail(client, stream_path) == before_tail
    assert read_messages(client, stream_path)[0] == events
    assert client.delete(f"{STATE}/streams/{stream_path}").status_code == 404

    again = register_ok(client, stream_path, SCHEMAS)
    assert again["materialized_offset"] == before_tail
    assert entity_map(client, stream_path) == model(events)


def test_unregistered_stream_is_plain_json_again(client: httpx.Client, stream_path: str) -> None:
    """STATE-PROTOCOL.md 3 and 7: once its registration is deleted, a stream is an ordinary JSON
    stream (PROTOCOL.md 9.1); its former schemas and event format no longer apply."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    append_ok(client, stream_path, [change("user", "1", {"name": "a"})])  # the server saw it
    assert client.delete(f"{STATE}/streams/{stream_path}").status_code == 204

    response = append(client, stream_path, [change("user", "2", {"age": 1})])
    assert response.status_code in (200, 204), response.text
    response = append(client, stream_path, [{"not": "a state event"}, 3])
    assert response.status_code in (200, 204), response.text


def test_reregistration_applies_the_new_schemas(client: httpx.Client, stream_path: str) -> None:
    """STATE-PROTOCOL.md 7: appends are validated against the schemas registered now, not the
    ones of an earlier registration of the same stream."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    append_ok(client, stream_path, [change("user", "1", {"name": "a"})])
    assert client.delete(f"{STATE}/streams/{stream_path}").status_code == 204
    register_ok(client, stream_path, {"user": {"type": "object", "required": ["id"]}})

    response = append(client, stream_path, [change("user", "2", {"id": 2})])
    assert response.status_code in (200, 204), response.text
    response = append(client, stream_path, [change("user", "3", {"name": "no id"})])
    assert response.status_code == 400, response.text
    assert '"id" is a required property' in response.text


def test_registry_cannot_be_unregistered(client: httpx.Client) -> None:
    """The __registry__ stream is always a state stream (state/registry.py): 403."""
    assert client.delete(f"{STATE}/streams/{REGISTRY}").status_code == 403
    assert registration(client, REGISTRY).status_code == 200


# -- deleting streams ------------------------------------------------------------------------


def _stored_state(pg: psycopg.Connection[Any], stream_id: int) -> tuple[int, int]:
    entity_rows = pg.execute("SELECT count(*) FROM ds_entity WHERE stream_id = %s", (stream_id,))
    registrations = pg.execute(
        "SELECT count(*) FROM ds_state_stream WHERE stream_id = %s", (stream_id,)
    )
    return entity_rows.fetchone()[0], registrations.fetchone()[0]  # type: ignore[index]


def test_deleting_a_stream_drops_its_state(
    client: httpx.Client, stream_path: str, pg: psycopg.Connection[Any]
) -> None:
    """PROTOCOL.md 5.3 (delete) with the state app: the registration and entities of a deleted
    stream are gone (API and database)."""
    create_json_stream(
        client, stream_path, [change("user", str(i), {"name": str(i)}) for i in range(5)]
    )
    register_ok(client, stream_path, SCHEMAS)
    sid = stream_id(pg, stream_path)
    assert _stored_state(pg, sid) == (5, 1)

    assert client.delete(stream_url(stream_path)).status_code == 204
    assert registration(client, stream_path).status_code == 404
    assert client.get(f"{STATE}/entities", params={"stream": stream_path}).status_code == 404
    assert _stored_state(pg, sid) == (0, 0)


def test_recreated_stream_is_not_a_state_stream(client: httpx.Client, stream_path: str) -> None:
    """PROTOCOL.md 5.1/5.3: a stream created at the path of a deleted state stream is a new,
    plain JSON stream: not registered, and it takes any JSON."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    append_ok(client, stream_path, [change("user", "1", {"name": "a"})])
    assert client.delete(stream_url(stream_path)).status_code == 204

    create_json_stream(client, stream_path)
    assert registration(client, stream_path).status_code == 404
    response = append(client, stream_path, [{"plain": "json"}])
    assert response.status_code in (200, 204), response.text
    assert read_messages(client, stream_path)[0] == [{"plain": "json"}]


def test_expired_stream_drops_its_state(
    client: httpx.Client, stream_path: str, pg: psycopg.Connection[Any]
) -> None:
    """PROTOCOL.md 5.1 (Stream-TTL): an expired state stream goes with its state, and the
    registry records its deletion."""
    response = client.put(
        stream_url(stream_path),
        headers=JSON | {"Stream-TTL": "2"},
        content=json.dumps([change("user", "1", {"name": "a"})]),
    )
    assert response.status_code == 201
    # Two seconds: the registration must come within the TTL, even on a loaded machine.
    register_ok(client, stream_path, SCHEMAS)
    sid = stream_id(pg, stream_path)
    time.sleep(4.2)
    assert client.head(stream_url(stream_path)).status_code == 404
    assert registration(client, stream_path).status_code == 404
    assert _stored_state(pg, sid) == (0, 0)
    assert entities(client, REGISTRY, type="stream", key=stream_path) == []


# -- pagination ------------------------------------------------------------------------------


def test_entities_pagination(client: httpx.Client, stream_path: str) -> None:
    """GET /v1/state/entities: DRF page-number pagination (count, next, previous, results),
    page_size honoured, entities ordered by type then key, filters by type and key."""
    events = [
        change(t, f"k{i:02d}", {"name": f"{t}{i}"} if t == "user" else i)
        for t in ("user", "note", "a-type")
        for i in range(9)
    ]
    create_json_stream(client, stream_path, events)
    register_ok(client, stream_path, SCHEMAS)
    expected = sorted(((e["type"], e["key"], e["value"]) for e in events), key=lambda x: x[:2])

    first = client.get(f"{STATE}/entities", params={"stream": stream_path, "page_size": 10}).json()
    assert first["count"] == 27
    assert first["previous"] is None
    assert len(first["results"]) == 10
    second = client.get(first["next"]).json()
    assert len(second["results"]) == 10
    assert second["previous"] is not None
    back = client.get(second["previous"]).json()
    assert back["results"] == first["results"]
    third = client.get(second["next"]).json()
    assert len(third["results"]) == 7
    assert third["next"] is None
    pages = first["results"] + second["results"] + third["results"]
    assert [(e["type"], e["key"], e["value"]) for e in pages] == expected

    for page_size in (1, 4, 27, 100):
        walked = walk_pages(
            client, f"{STATE}/entities", {"stream": stream_path, "page_size": page_size}
        )
        assert [(e["type"], e["key"], e["value"]) for e in walked] == expected

    notes = entities(client, stream_path, type="note")
    assert [(e["key"], e["value"]) for e in notes] == [(f"k{i:02d}", i) for i in range(9)]
    assert [e["value"] for e in entities(client, stream_path, type="user", key="k03")] == [
        {"name": "user3"}
    ]
    assert entities(client, stream_path, type="user", key="k99") == []
    assert entities(client, stream_path, type="nothing") == []


def test_entities_query_errors(client: httpx.Client, stream_path: str) -> None:
    """GET /v1/state/entities: the stream parameter is required (400); unknown streams and
    streams that are not state streams are 404."""
    create_json_stream(client, stream_path)
    assert client.get(f"{STATE}/entities").status_code == 400
    assert client.get(f"{STATE}/entities", params={"stream": ""}).status_code == 400
    assert client.get(f"{STATE}/entities", params={"stream": stream_path}).status_code == 404
    assert (
        client.get(f"{STATE}/entities", params={"stream": f"{stream_path}-none"}).status_code == 404
    )
    assert registration(client, f"{stream_path}-none").status_code == 404


def test_stream_catalog_pagination(client: httpx.Client, stream_path: str) -> None:
    """GET /v1/streams?prefix=: live streams by path, paginated; deleted streams are not
    listed; each entry has its content type and tail offset."""
    prefix = f"{stream_path}/"
    paths = [f"{prefix}{i:02d}" for i in range(13)]
    for i, path in enumerate(paths):
        content_type = "application/json" if i % 2 else "text/plain"
        assert (
            client.put(stream_url(path), headers={"Content-Type": content_type}).status_code == 201
        )
    assert client.delete(stream_url(paths[5])).status_code == 204
    live = [p for p in paths if p != paths[5]]

    first = client.get("/v1/streams", params={"prefix": prefix, "page_size": 5})
    assert first.status_code == 200, first.text
    page = first.json()
    assert page["count"] == 12
    assert page["previous"] is None
    assert [s["path"] for s in page["results"]] == live[:5]
    walked = walk_pages(client, "/v1/streams", {"prefix": prefix, "page_size": 5})
    assert [s["path"] for s in walked] == live
    for entry in walked:
        index = int(entry["path"][-2:])
        assert entry["content_type"] == ("application/json" if index % 2 else "text/plain")
        assert entry["tail_offset"] == tail(client, entry["path"])
    assert walk_pages(client, "/v1/streams", {"prefix": f"{prefix}1"}) == [
        e for e in walked if e["path"].startswith(f"{prefix}1")
    ]


# -- materialized offset ---------------------------------------------------------------------


def _listed(client: httpx.Client, path: str) -> dict[str, Any]:
    listed = walk_pages(client, f"{STATE}/streams", {"page_size": 1000})
    (entry,) = [r for r in listed if r["stream"] == path]
    return entry


def test_materialized_offset_is_the_tail(client: httpx.Client, stream_path: str) -> None:
    """GET /v1/state/streams/<path>: the registration's materialized_offset is the stream's
    tail (state-protocol-0.1.md 2.3: the state reflects every event up to there) as soon as an
    append is acknowledged (the detail catches up first; the list shows progress as is, and
    agrees once caught up); after small and large appends, a refused append and a close."""

    def materialized() -> str:
        return registration(client, stream_path).json()["materialized_offset"]

    create_json_stream(client, stream_path, [change("note", "a", 1)])
    register_ok(client, stream_path, SCHEMAS)
    assert materialized() == tail(client, stream_path)
    for i in range(5):
        end = append_ok(client, stream_path, [change("note", str(i), i), control("snapshot-end")])
        assert materialized() == end
    end = append_ok(client, stream_path, [change("note", str(i), i) for i in range(3000)])
    assert materialized() == end, "behind the tail"
    assert append(client, stream_path, [change("user", "x", {})]).status_code == 400
    assert materialized() == end
    closed = client.post(stream_url(stream_path), headers={"Stream-Closed": "true"})
    assert closed.status_code in (200, 204)
    assert materialized() == tail(client, stream_path)
    assert registration(client, stream_path).json() == _listed(client, stream_path)


def test_materialized_offset_reaches_the_tail_unprompted(
    client: httpx.Client, stream_path: str
) -> None:
    """state-protocol-0.1.md 2.3 on the server: after appends, the materialization reaches the
    tail by itself (nothing but the listing is read), within a few seconds."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    for _ in range(3):
        end = append_ok(client, stream_path, [change("note", str(i), i) for i in range(3000)])
    deadline = time.monotonic() + 10
    while _listed(client, stream_path)["materialized_offset"] != end:
        assert time.monotonic() < deadline, "materialization did not reach the tail in 10 s"
        time.sleep(0.05)


# -- OpenAPI ---------------------------------------------------------------------------------


def test_openapi_schema(client: httpx.Client) -> None:
    """GET /v1/schema: the OpenAPI document of the REST API answers 200 and describes it."""
    response = client.get("/v1/schema")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/vnd.oai.openapi")
    for path in ("/v1/state/entities", "/v1/state/streams", "/v1/streams"):
        assert f"{path}:" in response.text
    as_json = client.get("/v1/schema", params={"format": "json"})
    assert as_json.status_code == 200
    document = as_json.json()
    assert document["openapi"].startswith("3.")
    assert "/v1/state/entities" in document["paths"]


# -- robustness ------------------------------------------------------------------------------

# JSON that parses but that PostgreSQL's jsonb cannot hold (NUL characters, lone surrogates) or
# that Python decodes to a float it cannot encode back as JSON (infinity).
UNSTORABLE = [
    pytest.param(
        b'{"type":"note","key":"k","value":"a\\u0000b","headers":{"operation":"insert"}}',
        id="nul-in-value",
    ),
    pytest.param(
        b'{"type":"note","key":"k\\u0000","value":1,"headers":{"operation":"insert"}}',
        id="nul-in-key",
    ),
    pytest.param(
        b'{"type":"note","key":"k","value":"\\ud800","headers":{"operation":"insert"}}',
        id="lone-surrogate",
    ),
    pytest.param(
        b'{"type":"note","key":"k","value":1e400,"headers":{"operation":"insert"}}',
        id="number-beyond-double",
    ),
]


@pytest.mark.parametrize("body", UNSTORABLE)
def test_append_of_unusual_json_to_a_state_stream(
    client: httpx.Client, stream_path: str, body: bytes
) -> None:
    """STATE-PROTOCOL.md 9.3 (contents are untrusted): valid JSON the state store cannot hold
    never gets a 5xx; it is refused whole (4xx, nothing stored) or stored and materialized, and
    the stream's state keeps working afterwards."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path, SCHEMAS)
    before = state_of(client, stream_path)
    response = client.post(stream_url(stream_path), headers=JSON, content=body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert state_of(client, stream_path) == before
    else:
        materialized = client.get(f"{STATE}/entities", params={"stream": stream_path})
        assert materialized.status_code == 200, f"accepted, then entities: {materialized.text}"
        assert materialized.json()["count"] == 1
    append_ok(client, stream_path, [change("note", "after", 1)])
    materialized = client.get(f"{STATE}/entities", params={"stream": stream_path, "key": "after"})
    assert materialized.status_code == 200, f"later append, then entities: {materialized.text}"
    assert [e["value"] for e in materialized.json()["results"]] == [1]


@pytest.mark.parametrize("body", UNSTORABLE)
def test_registering_a_history_with_unusual_json(
    client: httpx.Client, stream_path: str, body: bytes
) -> None:
    """STATE-PROTOCOL.md 9.3 on backfill: an event of the history the state store cannot hold
    never makes registration fail with a 5xx; it is skipped and counted, or materialized."""
    create_json_stream(client, stream_path, [change("note", "ok", 1)])
    appended = client.post(stream_url(stream_path), headers=JSON, content=body)
    # A number beyond a double is refused by the base protocol itself (PROTOCOL.md 9.1.4: it
    # would be read back as Infinity, which is not JSON); the others are stored.
    assert appended.status_code in (200, 204, 400), appended.text
    events = 2 if appended.status_code < 300 else 1
    response = register(client, stream_path)
    assert response.status_code == 201, response.text
    assert response.json()["invalid_events"] + len(entities(client, stream_path)) == events


def test_registration_racing_appends(server: ServerProcess, stream_path: str) -> None:
    """STATE-PROTOCOL.md 7 and 9.2 under concurrency: appends that race a registration are
    either before it (kept in the stream, skipped by the backfill if invalid) or validated
    against its schema; no invalid event reaches the state, and every invalid one stored
    predates the registration."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        create_json_stream(client, stream_path)
    stop = threading.Event()
    invalid_stored = threading.Event()
    registered_at: list[float] = []
    late_invalid_accepted: list[str] = []

    def writer(n: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            i = 0
            while not stop.is_set():
                valid = i % 2 == 0
                value = {"name": f"{n}-{i}"} if valid else f"invalid {n}-{i}"
                started = time.monotonic()
                response = append(http, stream_path, [change("user", f"k{i % 4}", value)])
                assert response.status_code in (204, 200, 400), response.text
                if valid:
                    assert response.status_code in (200, 204), response.text
                elif response.status_code != 400 and registered_at and started > registered_at[0]:
                    late_invalid_accepted.append(value)
                elif response.status_code != 400:
                    invalid_stored.set()
                i += 1

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        writers = [pool.submit(writer, n) for n in range(4)]
        try:
            # Register once an invalid append is stored (a fixed wait could end before one).
            assert invalid_stored.wait(30), "no invalid append was stored"
            with httpx.Client(base_url=server.base_url, timeout=30) as client:
                body = register_ok(client, stream_path, SCHEMAS)
                registered_at.append(time.monotonic())
                time.sleep(0.5)
        finally:
            stop.set()
        for future in writers:
            future.result(timeout=30)  # a writer's failed assertion fails the test
    assert late_invalid_accepted == []
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        messages, _ = read_messages(client, stream_path)
        invalid = [m for m in messages if not isinstance(m["value"], dict)]
        assert invalid, "no append happened before the registration"
        assert len(messages) > len(invalid)
        # Every invalid event was counted by the backfill, so all of them predate it.
        assert body["invalid_events"] == len(invalid)
        valid = [m for m in messages if isinstance(m["value"], dict)]
        assert entity_map(client, stream_path) == model(valid)


# -- the __registry__ stream -----------------------------------------------------------------


def test_registry_is_a_readable_json_stream(client: httpx.Client, stream_path: str) -> None:
    """state/registry.py: /v1/stream/__registry__ is an application/json stream of State
    Events (state-protocol-0.1.md 4), one insert per created stream."""
    start = tail(client, REGISTRY)
    assert (
        client.put(stream_url(stream_path), headers={"Content-Type": "text/plain"}).status_code
        == 201
    )
    response = client.get(stream_url(REGISTRY), params={"offset": start})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    events, _ = read_messages(client, REGISTRY, start)
    for event in events:
        parse_event(event)  # every message is a valid State Event
    mine = [e for e in events if e.get("key") == stream_path]
    assert len(mine) == 1
    (event,) = mine
    assert event["type"] == "stream"
    assert event["headers"]["operation"] == "insert"
    datetime.fromisoformat(event["headers"]["timestamp"].replace("Z", "+00:00"))
    assert set(event["value"]) == {"path", "contentType", "createdAt"}
    assert event["value"]["path"] == stream_path
    assert event["value"]["contentType"] == "text/plain"
    (listed,) = client.get("/v1/streams", params={"prefix": stream_path}).json()["results"]
    assert _instant(event["value"]["createdAt"]) == _instant(listed["created_at"])


def _instant(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@pytest.mark.parametrize(
    ("method", "headers", "body"),
    [
        ("PUT", JSON, None),
        ("PUT", {"Content-Type": "text/plain"}, b"x"),
        ("POST", JSON, json.dumps(change("stream", "forged", {"path": "forged"})).encode()),
        ("POST", {"Stream-Closed": "true"}, None),
        ("DELETE", {}, None),
    ],
)
def test_registry_is_read_only(
    client: httpx.Client, method: str, headers: dict[str, str], body: bytes | None
) -> None:
    """state/registry.py: only the server writes the registry; PUT, POST and DELETE are 403 and
    change nothing."""
    response = client.request(method, stream_url(REGISTRY), headers=headers, content=body)
    assert response.status_code == 403, response.text
    head = client.head(stream_url(REGISTRY))
    assert head.status_code == 200
    assert head.headers.get("Stream-Closed") is None
    assert entities(client, REGISTRY, type="stream", key="forged") == []


def test_registry_records_concurrent_creates_and_deletes(
    server: ServerProcess, stream_path: str
) -> None:
    """state/registry.py under concurrency: 40 tasks create, delete and re-create distinct
    streams at once; the registry's materialized state holds exactly the live ones, with their
    content type, and its stream has, per stream, inserts and deletes alternating in the order
    each stream lived them."""
    # (path, content type, lifecycle): "c" create, "d" delete
    plans = []
    for i in range(40):
        lifecycle = ["c", "cd", "cdc", "c", "cd"][i % 5]
        content_type = ["application/json", "text/plain", "application/octet-stream"][i % 3]
        plans.append((f"{stream_path}/s{i:02d}", content_type, lifecycle))

    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        start = tail(client, REGISTRY)

    async def live_one(http: httpx.AsyncClient, path: str, content_type: str, steps: str) -> None:
        for step in steps:
            if step == "c":
                response = await http.put(stream_url(path), headers={"Content-Type": content_type})
                assert response.status_code == 201, response.text
            else:
                response = await http.delete(stream_url(path))
                assert response.status_code == 204, response.text

    async def run_all() -> None:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as http:
            await asyncio.gather(*(live_one(http, *plan) for plan in plans))

    asyncio.run(run_all())

    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for path, content_type, lifecycle in plans:
            found = entities(client, REGISTRY, type="stream", key=path)
            if lifecycle.endswith("c"):
                assert len(found) == 1, (path, found)
                assert found[0]["value"]["path"] == path
                assert found[0]["value"]["contentType"] == content_type
            else:
                assert found == [], (path, found)

        events, _ = read_messages(client, REGISTRY, start)
        by_path: dict[str, list[str]] = {}
        for event in events:
            if isinstance(event, dict) and str(event.get("key", "")).startswith(f"{stream_path}/"):
                by_path.setdefault(event["key"], []).append(event["headers"]["operation"])
        expected = {
            path: ["insert" if step == "c" else "delete" for step in lifecycle]
            for path, _, lifecycle in plans
        }
        assert by_path == expected

        # The catalog agrees with the registry on which streams are live.
        catalog = walk_pages(client, "/v1/streams", {"prefix": f"{stream_path}/", "page_size": 100})
        assert [s["path"] for s in catalog] == sorted(p for p, _, lc in plans if lc.endswith("c"))


def test_registry_events_are_valid_state_events(client: httpx.Client, stream_path: str) -> None:
    """state-protocol-0.1.md 4.1: a delete in the registry is a Change Event without a value,
    with an RFC 3339 timestamp; the core parser accepts every registry event."""
    start = tail(client, REGISTRY)
    create_json_stream(client, stream_path)
    assert client.delete(stream_url(stream_path)).status_code == 204
    events, _ = read_messages(client, REGISTRY, start)
    mine = [e for e in events if e.get("key") == stream_path]
    assert [e["headers"]["operation"] for e in mine] == ["insert", "delete"]
    assert "value" not in mine[1]
    for event in events:
        try:
            parse_event(event)
        except InvalidEvent as exc:
            pytest.fail(f"registry event {event!r} is invalid: {exc}")


def test_registry_event_timestamps_are_inlined(pg: Any) -> None:
    """Every create and delete builds a registry event with two RFC 3339 timestamps. Declared
    IMMUTABLE over to_char (stable), ds_rfc3339 was never inlined: each call ran as a function
    of its own, 21 us of a create's 350 (docs/benchmarks.md)."""
    plan = pg.execute("EXPLAIN (VERBOSE, FORMAT JSON) SELECT ds_rfc3339(now())").fetchone()[0]
    (output,) = plan[0]["Plan"]["Output"]
    assert output.startswith("to_char("), output


def _nested_event(key: str, depth: int) -> bytes:
    """An append of one change whose value nests ``depth`` objects deep (written out: the
    test's own encoder has Python's limits too)."""
    event = f'{{"type":"t","key":"{key}","headers":{{"operation":"insert"}},"value":'
    return b"[" + event.encode() + b'{"a":' * depth + b"1" + b"}" * depth + b"}]"


def test_a_value_nested_past_the_limit_cannot_break_the_entities_list(
    client: httpx.Client, stream_path: str
) -> None:
    """Probe 9c: an event whose value nested 956-967 deep was stored, and from then on every
    read of the stream's entities answered 500 (decoding it again in a Django thread, deeper in
    the stack, passed Python's limit). JSON nests at most 128 levels now (an append's array and
    its event take two of them): the deepest value allowed reads back, a deeper one is refused
    and stores nothing."""
    create_json_stream(client, stream_path)
    register_ok(client, stream_path)
    url = f"/v1/stream/{stream_path}"
    assert client.post(url, headers=JSON, content=_nested_event("deep", 126)).status_code == 204
    for depth in (127, 960):
        refused = client.post(url, headers=JSON, content=_nested_event("deeper", depth))
        assert refused.status_code == 400, refused.text
    found = entities(client, stream_path)
    assert [(e["key"], json.dumps(e["value"]).count("{")) for e in found] == [("deep", 126)]


def test_urls_that_are_not_utf8_are_refused(client: httpx.Client, stream_path: str) -> None:
    """Probe 9b: Django read %FF as U+FFFD, so two URLs named one state stream (a DELETE through
    either removed it), and list filters matched what nobody sent. They are 400s now, as the
    protocol endpoints answer them."""
    path = f"{stream_path}-\ufffd"
    create_json_stream(client, path)
    register_ok(client, path)
    encoded = f"{STATE}/streams/{stream_path}-"
    assert client.get(encoded + "%EF%BF%BD").status_code == 200
    for url in (
        encoded + "%FF",
        f"{STATE}/entities?stream={stream_path}-%FF",
        "/v1/streams?prefix=%ff",
    ):
        answer = client.get(url)
        assert answer.status_code == 400, (url, answer.text)
        assert answer.json()["code"] == "BAD_REQUEST" and "not UTF-8" in answer.text
    assert client.delete(encoded + "%FF").status_code == 400
    assert client.get(encoded + "%EF%BF%BD").status_code == 200


def test_one_registration_at_a_time_and_others_refused_at_once(
    server: ServerProcess, database_url: str, stream_path: str
) -> None:
    """Probe 9a: registrations of one long stream, 12 at once, each waited for the stream's lock
    holding one of the process's four Django connections, and other clients' requests were
    answered 503 "the database is unavailable". A process makes one registration at a time:
    another meanwhile is refused at once (503, Retry-After) and holds nothing, and the rest of
    the API is answered as usual."""
    first, second = f"{stream_path}/first", f"{stream_path}/second"
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        create_json_stream(client, first)
        create_json_stream(client, second)
        with psycopg.connect(database_url, autocommit=False) as holder:
            # The first registration waits for this lock: it is under way meanwhile.
            holder.execute("SELECT 1 FROM ds_stream WHERE path = %s FOR UPDATE", [first])
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                registering = pool.submit(register, client, first)
                deadline = time.monotonic() + 10
                while not _waits_for_a_lock(database_url):
                    assert time.monotonic() < deadline, "the registration never began"
                    time.sleep(0.05)
                refused = register(client, second)
                assert refused.status_code == 503, refused.text
                assert refused.headers["Retry-After"] == "1"
                assert client.get("/v1/streams", params={"prefix": stream_path}).status_code == 200
                holder.rollback()
                assert registering.result(timeout=30).status_code == 201
        assert register(client, second).status_code == 201


def _waits_for_a_lock(database_url: str) -> bool:
    with psycopg.connect(database_url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        ).fetchone()
    return bool(found and found[0])


def test_a_page_of_entities_holds_a_bounded_number_of_bytes(
    start_server: Any, stream_path: str
) -> None:
    """Probe 10b: a page of entities was built whole whatever its values held (1,000 values of
    2 MB: 1.9 GB for four pages at once, kept by the allocator, other clients waiting). A page
    holds at most about DS_READ__MAX_CHUNK_BYTES of values (always one entity at least); past
    it the request is refused before the values are read, saying how many fit."""
    server = start_server(env={"DS_READ__MAX_CHUNK_BYTES": "100000"})
    value = {"text": "v" * 40_000}
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        create_json_stream(client, stream_path)
        register_ok(client, stream_path)
        append_ok(client, stream_path, [change("t", f"k{i}", value) for i in range(5)])
        url = f"{STATE}/entities"
        refused = client.get(url, params={"stream": stream_path, "page_size": 100})
        assert refused.status_code == 413, refused.text
        assert "at most 2 per page" in refused.text
        found = walk_pages(client, url, {"stream": stream_path, "page_size": 2})
        assert [e["key"] for e in found] == [f"k{i}" for i in range(5)]
        assert all(e["value"] == value for e in found)
        big = {"text": "w" * 200_000}
        append_ok(client, stream_path, [change("t", "k9", big)])
        (alone,) = client.get(url, params={"stream": stream_path, "key": "k9"}).json()["results"]
        assert alone["value"] == big
