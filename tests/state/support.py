"""HTTP helpers shared by the state tests: streams over the Durable Streams protocol, and the
state API (registrations, entities) with its pagination walked to the end."""

from __future__ import annotations

import json
from typing import Any

import httpx
import psycopg

JSON = {"Content-Type": "application/json"}
STATE = "/v1/state"
REGISTRY = "__registry__"


USER_SCHEMA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
}


def stream_url(path: str) -> str:
    return f"/v1/stream/{path}"


def change(type_name: str, key: str, value: Any = None, op: str = "insert", **headers: Any) -> dict:
    """A Change Event (STATE-PROTOCOL.md 5.1); a delete carries no value."""
    event: dict[str, Any] = {"type": type_name, "key": key, "headers": {"operation": op, **headers}}
    if op != "delete":
        event["value"] = value
    return event


def control(kind: str, **headers: Any) -> dict:
    """A Control Event (STATE-PROTOCOL.md 5.2)."""
    return {"headers": {"control": kind, **headers}}


def create_json_stream(client: httpx.Client, path: str, events: list[Any] | None = None) -> None:
    body = json.dumps(events) if events else None
    response = client.put(stream_url(path), headers=JSON, content=body)
    assert response.status_code == 201, response.text


def append(client: httpx.Client, path: str, events: list[Any]) -> httpx.Response:
    """POST one append of JSON messages (PROTOCOL.md 9.1: the array is flattened one level)."""
    return client.post(stream_url(path), headers=JSON, content=json.dumps(events))


def append_ok(client: httpx.Client, path: str, events: list[Any]) -> str:
    """Append and return the Stream-Next-Offset of the acknowledgement."""
    response = append(client, path, events)
    assert response.status_code in (200, 204), response.text
    return response.headers["Stream-Next-Offset"]


def append_batches(client: httpx.Client, path: str, events: list[Any], size: int = 1000) -> None:
    """Append ``events`` in appends of ``size`` messages each."""
    for start in range(0, len(events), size):
        append_ok(client, path, events[start : start + size])


def tail(client: httpx.Client, path: str) -> str:
    response = client.head(stream_url(path))
    assert response.status_code == 200, response.status_code
    return response.headers["Stream-Next-Offset"]


def read_messages(client: httpx.Client, path: str, offset: str = "-1") -> tuple[list[Any], str]:
    """Every message from ``offset`` to the tail (catch-up reads until Stream-Up-To-Date), and
    the offset after the last one."""
    messages: list[Any] = []
    while True:
        response = client.get(stream_url(path), params={"offset": offset})
        assert response.status_code == 200, response.text
        messages.extend(response.json())
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            return messages, offset


def register(
    client: httpx.Client, path: str, schemas: dict[str, Any] | None = None
) -> httpx.Response:
    payload: dict[str, Any] = {"stream": path}
    if schemas is not None:
        payload["schemas"] = schemas
    return client.post(f"{STATE}/streams", json=payload)


def register_ok(client: httpx.Client, path: str, schemas: dict[str, Any] | None = None) -> dict:
    response = register(client, path, schemas)
    assert response.status_code == 201, response.text
    return response.json()


def registration(client: httpx.Client, path: str) -> httpx.Response:
    return client.get(f"{STATE}/streams/{path}")


def walk_pages(client: httpx.Client, url: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """All results of a paginated DRF list, following ``next`` links; checks that every page
    reports the same ``count`` and that the total matches it."""
    response = client.get(url, params=params)
    assert response.status_code == 200, response.text
    page = response.json()
    count = page["count"]
    results = list(page["results"])
    assert page["previous"] is None
    while page["next"] is not None:
        response = client.get(page["next"])
        assert response.status_code == 200, response.text
        page = response.json()
        assert page["count"] == count
        assert page["previous"] is not None
        results.extend(page["results"])
    assert len(results) == count
    return results


def entities(client: httpx.Client, path: str, **filters: str) -> list[dict[str, Any]]:
    """The whole materialized state of a state stream, every page."""
    return walk_pages(client, f"{STATE}/entities", {"stream": path, "page_size": 1000, **filters})


def entity_map(client: httpx.Client, path: str) -> dict[tuple[str, str], Any]:
    return {(e["type"], e["key"]): e["value"] for e in entities(client, path)}


def model(events: list[dict[str, Any]]) -> dict[tuple[str, str], Any]:
    """state-protocol-0.1.md 5.2/5.3 written out, for valid events: per (type, key) the last
    change wins, deletes remove, a reset clears everything before it."""
    state: dict[tuple[str, str], Any] = {}
    for event in events:
        headers = event["headers"]
        if "control" in headers:
            if headers["control"] == "reset":
                state.clear()
        elif headers["operation"] == "delete":
            state.pop((event["type"], event["key"]), None)
        else:
            state[(event["type"], event["key"])] = event["value"]
    return state


def stream_id(pg: psycopg.Connection[Any], path: str) -> int:
    """The id of the live stream at ``path``, read from the database."""
    row = pg.execute("SELECT id FROM ds_stream WHERE path = %s", [path]).fetchone()
    assert row is not None, path
    return row[0]
