"""The official TypeScript client (npm @durable-streams/client, pinned in tests/js/package.json)
against the production server command.

The test runs tests/js/clients/typescript_client.mjs with Node. That script drives the client
and records every request the client made (through the client's `fetch` option). This module
checks the script's report, and then re-reads the streams over plain HTTP, so the assertions
cover what the server stored as well as what the client saw.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import httpx
import pytest

from tests.conftest import JS_DIR, ServerProcess, run_node

SCRIPT = JS_DIR / "clients" / "typescript_client.mjs"

# The values typescript_client.mjs appends, in order (keep in sync with the script).
JSON_ROUND_1 = [{"n": 1, "text": "héllo ✓"}, [1, 2, {"nested": True}], "a string"]
JSON_ROUND_2 = [42, None, {"n": 2}]
JSON_LONG_POLL = {"live": "long-poll", "n": 3}
JSON_SSE = {"live": "sse", "n": 4}
BIN_ROUND = bytes([0, 1, 2, 253, 254, 255]) + b"durable"
BIN_SSE = bytes([10, 0, 13, 255, 128, 61])


def run_script(stream_base: str) -> dict[str, Any]:
    return run_node(SCRIPT, stream_base)


def sse_events(body: str) -> list[tuple[str, str]]:
    """(event type, data) pairs of an SSE body, data lines joined by newlines (PROTOCOL.md 5.8)."""
    events = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        kind, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                kind = line[len("event:") :].strip()
            elif line.startswith("data:"):
                value = line[len("data:") :]
                data.append(value[1:] if value.startswith(" ") else value)
        if data:
            events.append((kind, "\n".join(data)))
    return events


def live_requests(requests: list[dict[str, Any]]) -> list[str | None]:
    return [request["live"] for request in requests]


def check_live_delivery(live: dict[str, Any], mode: str) -> dict[str, Any]:
    """The first `live=<mode>` request was open before the append and delivered it; any later
    one is the client polling on from the new tail before the script aborted the read."""
    live_gets = [r for r in live["requests"] if r["live"] is not None]
    assert live_gets, live["requests"]
    assert {r["live"] for r in live_gets} == {mode}, live["requests"]
    request = live_gets[0]
    assert request.get("status") == 200, request
    assert request["startedAt"] < live["appendedAt"], request
    assert all(r["offset"] == live["offset"] for r in live_gets[1:]), live["requests"]
    return request


@pytest.fixture(scope="module")
def report(server: ServerProcess) -> dict[str, Any]:
    """One run of the script, shared by the JSON and binary tests."""
    return run_script(server.stream_url(f"tests/ts-client-{time.time_ns()}"))


def test_typescript_client_json_stream(report: dict[str, Any], client: httpx.Client) -> None:
    """PROTOCOL.md 5.1 (create), 5.2.1 (IdempotentProducer appends), 5.6 (catch-up read),
    5.7 (long-poll live read), 5.8 (SSE live read), 9.1 (JSON mode) with the TypeScript client.
    """
    result = report["json"]
    everything = [*JSON_ROUND_1, *JSON_ROUND_2, JSON_LONG_POLL, JSON_SSE]

    # 5.1: the create response kept the stream's content type on the handle.
    assert result["handleContentType"] == "application/json"

    # 5.2.1: four batches (two fire-and-forget rounds, then one append per live read), epoch 0,
    # consecutive seqs, each answered 200 with a strictly increasing Stream-Next-Offset.
    producer = result["producer"]
    assert producer["errors"] == []
    posts = producer["requests"]
    assert [(r["method"], r["producerEpoch"], r["producerSeq"]) for r in posts] == [
        ("POST", "0", str(seq)) for seq in range(4)
    ]
    assert [r["status"] for r in posts] == [200] * 4
    offsets = [r["nextOffset"] for r in posts]
    assert all(offsets) and offsets == sorted(set(offsets)), offsets
    assert (producer["epoch"], producer["nextSeq"]) == (0, 4)
    assert producer["lastOffset"] == offsets[-1]

    # 5.6 / 9.1: the catch-up read returned exactly the two rounds, in order, and stopped at the
    # tail (the batch of seq 1 ends there).
    catch_up = result["catchUp"]
    assert catch_up["items"] == [*JSON_ROUND_1, *JSON_ROUND_2]
    assert catch_up["upToDate"] is True
    assert catch_up["offset"] == offsets[1]
    assert [(r["offset"], r["live"], r["status"]) for r in catch_up["requests"]] == [
        ("-1", None, 200)
    ]
    assert catch_up["requests"][0]["contentType"].startswith("application/json")

    # 5.7: the client caught up with a plain GET, then parked a long-poll that the later append
    # answered with exactly that item.
    long_poll = result["longPoll"]
    assert live_requests(long_poll["requests"])[0] is None
    assert None not in live_requests(long_poll["requests"])[1:]
    request = check_live_delivery(long_poll, "long-poll")
    assert request["offset"] == offsets[1]
    assert request["headersAt"] > long_poll["appendedAt"], request
    assert request["nextOffset"] == offsets[2]
    assert json.loads(request["body"]) == [JSON_LONG_POLL]
    delivered = [b["items"] for b in long_poll["batches"] if b["hasData"]]
    assert delivered == [[JSON_LONG_POLL]]
    assert long_poll["offset"] == offsets[2]

    # 5.8: one SSE connection; its first control event said "caught up" at the tail, then the
    # later append arrived as a data event followed by a control event with the new offset.
    sse = result["sse"]
    assert live_requests(sse["requests"])[:2] == [None, "sse"]
    request = check_live_delivery(sse, "sse")
    assert request["offset"] == offsets[2]
    assert request["contentType"].startswith("text/event-stream")
    assert request["sseDataEncoding"] is None
    events = sse_events(request["body"])
    control_events = [json.loads(data) for kind, data in events if kind == "control"]
    data_events = [json.loads(data) for kind, data in events if kind == "data"]
    assert control_events[0]["streamNextOffset"] == offsets[2]
    assert control_events[0]["upToDate"] is True
    assert [kind for kind, _ in events][-2:] == ["data", "control"]
    assert data_events[-1] == [JSON_SSE]
    assert control_events[-1]["streamNextOffset"] == offsets[3]
    assert control_events[-1]["upToDate"] is True
    assert [item for batch in data_events for item in batch] == [JSON_SSE]
    delivered = [b["items"] for b in sse["batches"] if b["hasData"]]
    assert delivered == [[JSON_SSE]]

    # What the server stored, read over plain HTTP (5.6, 9.1.5).
    response = client.get(result["url"], params={"offset": "-1"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == everything
    assert response.headers["stream-next-offset"] == offsets[3]
    assert response.headers["stream-up-to-date"] == "true"


def test_typescript_client_binary_stream(report: dict[str, Any], client: httpx.Client) -> None:
    """PROTOCOL.md 5.1 (create), 5.2.1 (IdempotentProducer appends), 5.6 (catch-up read) and
    5.8 (SSE live read of a binary stream: base64 data events) with the TypeScript client."""
    result = report["binary"]
    assert result["handleContentType"] == "application/octet-stream"

    producer = result["producer"]
    assert producer["errors"] == []
    posts = producer["requests"]
    assert [(r["producerEpoch"], r["producerSeq"], r["status"]) for r in posts] == [
        ("0", "0", 200),
        ("0", "1", 200),
    ]
    first, second = (r["nextOffset"] for r in posts)
    assert first < second
    assert producer["lastOffset"] == second

    # 5.6: the two chunks of the first batch, concatenated.
    catch_up = result["catchUp"]
    assert bytes(catch_up["bytes"]) == BIN_ROUND
    assert catch_up["upToDate"] is True
    assert catch_up["offset"] == first

    # 5.8: binary SSE is base64-encoded and announced by Stream-SSE-Data-Encoding; the client
    # decoded the later append back to the exact bytes (including \n, \r and "=").
    sse = result["sse"]
    assert live_requests(sse["requests"])[:2] == [None, "sse"]
    request = check_live_delivery(sse, "sse")
    assert request["offset"] == first
    assert request["sseDataEncoding"] == "base64"
    events = sse_events(request["body"])
    data_events = [data for kind, data in events if kind == "data"]
    assert [base64.b64decode(data.replace("\n", "")) for data in data_events] == [BIN_SSE]
    assert json.loads(events[-1][1])["streamNextOffset"] == second
    delivered = [bytes(b["bytes"]) for b in sse["batches"] if b["hasData"]]
    assert delivered == [BIN_SSE]

    response = client.get(result["url"], params={"offset": "-1"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.content == BIN_ROUND + BIN_SSE
    assert response.headers["stream-next-offset"] == second
