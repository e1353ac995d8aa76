"""Cross-check with the reference implementation: the npm package @durable-streams/state
(pinned in tests/js/package.json) materializes a state stream read from our server, and the
result must equal our server's materialized state entity for entity.

tests/js/state/materialize.mjs reads the whole stream with a catch-up read of
@durable-streams/client and applies it with the package's ``MaterializedState``, clearing the
state on ``reset`` as state-protocol-0.1.md 8 does. The stream is built to cover the
materialization rules: many types and keys, values of every JSON kind, updates, deletes, a reset,
snapshot markers; part of it predates the registration (the server's backfill) and the rest is
appended after it (materialized as appends arrive). A server with a small read chunk makes the
client's catch-up take several requests.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import pytest

from state.core import MaterializedState
from tests.conftest import JS_DIR, ServerProcess, manage, run_node
from tests.state.support import (
    STATE,
    append_ok,
    change,
    control,
    create_json_stream,
    model,
    read_messages,
    register_ok,
    tail,
    walk_pages,
)

SCRIPT = JS_DIR / "state" / "materialize.mjs"

SCHEMAS = {
    "user": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
    "flag": {"type": "boolean"},
}
TYPES = ["user", "message", "flag", "config", "presence", "réaction"]
STRINGS = ["", "plain", 'quote " and \\ backslash', "line\nbreak\ttab", "héllo ✓ 😀", "</script>"]


def random_value(rng: random.Random, entity_type: str, depth: int = 0) -> Any:
    """A value of the entity type's schema, or any JSON value for types without one."""
    if entity_type == "user":
        return {"name": rng.choice(STRINGS), "n": rng.randint(-1000, 1000),
                "tags": [rng.choice(STRINGS) for _ in range(rng.randint(0, 3))]}  # fmt: skip
    if entity_type == "flag":
        return rng.random() < 0.5
    kinds = ["null", "bool", "int", "float", "string", "list", "object"]
    kind = rng.choice(kinds if depth < 2 else kinds[:5])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-(2**53), 2**53)
    if kind == "float":
        return rng.choice([0.5, -2.25, 3.125, 1e-3, 123456.75])
    if kind == "string":
        return rng.choice(STRINGS)
    if kind == "list":
        return [random_value(rng, entity_type, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(STRINGS) or "k": random_value(rng, entity_type, depth + 1)
        for _ in range(rng.randint(0, 3))
    }


def random_events(rng: random.Random, count: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for i in range(count):
        entity_type = rng.choice(TYPES)
        key = f"{entity_type[:2]}:{rng.randint(0, 24)}"
        roll = rng.random()
        if roll < 0.03:
            events.append(control(rng.choice(["snapshot-start", "snapshot-end", "up-to-date"])))
        elif roll < 0.18:
            event = change(entity_type, key, op="delete")
            if rng.random() < 0.3:
                event["old_value"] = random_value(rng, entity_type)
            events.append(event)
        else:
            op = "insert" if roll < 0.5 else "update"
            headers: dict[str, Any] = {}
            if rng.random() < 0.2:
                headers["txid"] = f"tx-{i // 5}"
            if rng.random() < 0.2:
                headers["timestamp"] = "2025-01-15T10:30:00.5+02:00"
            events.append(change(entity_type, key, random_value(rng, entity_type), op, **headers))
    return events


def run_script(url: str) -> dict[str, Any]:
    return run_node(SCRIPT, url)


def triples(entities: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(type, key, value as canonical JSON), sorted: comparable across Python and JS."""
    return sorted((e["type"], e["key"], json.dumps(e["value"], sort_keys=True)) for e in entities)


@pytest.fixture(scope="module")
def small_chunk_server(start_server: Any) -> ServerProcess:
    """A server whose catch-up reads return at most 2 KiB, so a client needs many of them."""
    return start_server(env={"DS_READ__MAX_CHUNK_BYTES": "2048"})


def test_reference_client_materializes_what_the_server_does(
    small_chunk_server: ServerProcess,
) -> None:
    """state-protocol-0.1.md 5 (state semantics), 6 (MaterializedState) and 8 (JSON-mode binding,
    reset handled by clearing): the reference MaterializedState applied to the stream as read
    by the reference client equals /v1/state/entities, entity for entity (type, key, value);
    and both equal this project's core materialization of the same messages."""
    rng = random.Random(20250115)
    path = f"tests/reference-client-{time.time_ns()}"
    before_registration = random_events(rng, 250)
    after_registration = [
        random_events(rng, 120),
        [*random_events(rng, 10), control("reset", offset="0_0"), *random_events(rng, 30)],
        random_events(rng, 200),
        [control("snapshot-start"), *random_events(rng, 60), control("snapshot-end")],
    ]
    with httpx.Client(base_url=small_chunk_server.base_url, timeout=30) as client:
        create_json_stream(client, path, before_registration)
        registered = register_ok(client, path, SCHEMAS)
        assert registered["invalid_events"] == 0
        for batch in after_registration:
            append_ok(client, path, batch)
        end = tail(client, path)
        messages, _ = read_messages(client, path)
        served = walk_pages(client, f"{STATE}/entities", {"stream": path, "page_size": 37})

    # The stream is exactly what was written, with its one reset.
    written = [*before_registration, *(e for batch in after_registration for e in batch)]
    assert messages == written
    resets = sum(1 for e in written if e["headers"].get("control") == "reset")
    assert resets == 1

    report = run_script(small_chunk_server.stream_url(path))

    # The reference client read the whole stream, in several catch-up requests, to the tail.
    requests = report["requests"]
    assert len(requests) > 3, requests
    assert all(r["status"] == 200 and r["live"] is None for r in requests), requests
    assert requests[-1]["upToDate"] is True
    assert report["offset"] == end
    assert report["events"] == len(written)
    assert report["controls"]["reset"] == 1
    assert report["changes"] == sum(1 for e in written if "operation" in e["headers"])

    # Entity for entity: reference package == our server == our core == the spec model.
    reference = triples(report["entities"])
    assert len(reference) > 50
    assert reference == triples(served)
    core = MaterializedState()
    core.apply_batch(messages)
    ours = [{"type": t, "key": k, "value": v} for t, k, v in core.items()]
    assert reference == triples(ours)
    spec = [{"type": t, "key": k, "value": v} for (t, k), v in model(messages).items()]
    assert reference == triples(spec)


def test_reference_client_materializes_a_compacted_stream_as_before(
    small_chunk_server: ServerProcess, database_url: str
) -> None:
    """Issue 14 (compaction): the reference MaterializedState, applied to the stream read from
    -1 by the reference client, gives exactly the same entities after the server compacted the
    stream as before, on a history with inserts, updates, deletes and a reset; the server's
    own state (/v1/state/entities, values and offsets) does not change either. Compaction kept
    far fewer events, and the client read them in several catch-up requests."""
    rng = random.Random(20261123)
    path = f"tests/reference-client-compaction-{time.time_ns()}"
    with httpx.Client(base_url=small_chunk_server.base_url, timeout=30) as client:
        create_json_stream(client, path, random_events(rng, 200))
        registration = {"stream": path, "schemas": SCHEMAS, "compaction": True}
        response = client.post(f"{STATE}/streams", json=registration)
        assert response.status_code == 201, response.text
        for batch in [
            random_events(rng, 300),
            [*random_events(rng, 40), control("reset", offset="0_0"), *random_events(rng, 60)],
            random_events(rng, 400),
        ]:
            append_ok(client, path, batch)
        written, end = read_messages(client, path)
        deletes = sum(1 for e in written if e["headers"].get("operation") == "delete")
        assert deletes > 50 and sum(1 for e in written if "control" in e["headers"]) > 1
        served_before = walk_pages(client, f"{STATE}/entities", {"stream": path, "page_size": 50})

        before = run_script(small_chunk_server.stream_url(path))
        compacted = manage(database_url, "compact_state", "--stream", path)
        assert compacted.returncode == 0, compacted.stderr
        after = run_script(small_chunk_server.stream_url(path))

        served_after = walk_pages(client, f"{STATE}/entities", {"stream": path, "page_size": 50})
        kept, end_after = read_messages(client, path)

    assert before["events"] == len(written) and before["controls"]["reset"] == 1
    assert after["events"] == len(kept) < len(written) // 3
    assert after["controls"] == {"reset": 1}
    assert len(after["requests"]) > 3 and after["requests"][-1]["upToDate"] is True
    assert before["offset"] == after["offset"] == end == end_after
    reference = triples(after["entities"])
    assert len(reference) > 50
    assert reference == triples(before["entities"]) == triples(served_after)
    assert served_after == served_before
