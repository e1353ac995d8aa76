"""The official Python client (PyPI durable-streams) against the production server command.

Each test drives the client end to end, then re-reads the stream over plain HTTP, so the
assertions cover what the server stored as well as what the client saw.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import httpx
from durable_streams import (
    AsyncDurableStream,
    DurableStream,
    StreamEvent,
    astream,
    stream,
)

from tests.conftest import ServerProcess

TIMEOUT = 10.0

JSON_ITEMS: list[Any] = [{"n": 1, "text": "héllo ✓"}, [1, 2, {"nested": True}], "a string", None]
JSON_LIVE: list[Any] = [{"live": 1}, {"live": 2}]
TEXT_CHUNKS = ["first line\nsecond line\n", "ünïcode ✓ "]
TEXT_LIVE = "live text\nover SSE"


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_python_client_json_stream(
    server: ServerProcess, stream_path: str, client: httpx.Client
) -> None:
    """PROTOCOL.md 5.1 (create), 5.2 (append), 5.5 (HEAD), 5.6 (catch-up read), 5.8 (SSE read
    that catches up and then receives later appends) and 9.1 (JSON mode) with the Python client.
    """
    url = server.stream_url(stream_path)
    handle = DurableStream.create(url, content_type="application/json", timeout=TIMEOUT)
    try:
        # 5.1 / 5.2: the client sends each value wrapped in an array; the server stores the
        # value itself (a list value stays one message, 9.1.2).
        assert handle.content_type == "application/json"
        offsets = [handle.append(item).next_offset for item in JSON_ITEMS]
        assert all(offsets) and offsets == sorted(set(offsets)), offsets
        tail = offsets[-1]

        head = handle.head()
        assert (head.exists, head.content_type, head.offset) == (True, "application/json", tail)

        # 5.6: catch-up from the start returns exactly the stored messages, up to date.
        with stream(url, offset="-1", live=False, timeout=TIMEOUT) as res:
            assert res.read_json() == JSON_ITEMS
            assert (res.offset, res.up_to_date) == (tail, True)

        # 5.8: an SSE read from the start gets the stored messages as SSE events, reports "up to
        # date" at the tail, and then receives appends made after that point.
        events: list[StreamEvent[Any]] = []
        expected_count = len(JSON_ITEMS) + len(JSON_LIVE)

        def count() -> int:
            return sum(len(event.data) for event in events)

        # Leaving the stream first closes the response, which ends a reader still waiting.
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            stream(url, offset="-1", live="sse", timeout=TIMEOUT) as res,
        ):
            assert res.content_type is not None
            assert res.content_type.startswith("text/event-stream")
            assert res.up_to_date is False  # set only by a control event

            def read_live() -> None:
                for event in res.iter_events(mode="json"):
                    events.append(event)
                    if count() >= expected_count:
                        return

            def caught_up_or_failed() -> bool:
                if reader.done():
                    reader.result()  # re-raises the reader's failure here
                return res.up_to_date and count() == len(JSON_ITEMS)

            reader = pool.submit(read_live)
            wait_until(caught_up_or_failed, "SSE catch-up")
            caught_up = list(events)
            live_offsets = [handle.append(item).next_offset for item in JSON_LIVE]
            reader.result(TIMEOUT)

        assert [item for event in caught_up for item in event.data] == JSON_ITEMS
        assert (caught_up[-1].next_offset, caught_up[-1].up_to_date) == (tail, True)
        live_events = events[len(caught_up) :]
        assert [item for event in live_events for item in event.data] == JSON_LIVE
        assert tail < live_offsets[0] < live_offsets[1]
        assert (live_events[-1].next_offset, live_events[-1].up_to_date) == (live_offsets[1], True)
    finally:
        handle.close()

    # What the server stored, read over plain HTTP (5.6, 9.1.5).
    response = client.get(url, params={"offset": "-1"})
    assert response.status_code == 200
    assert response.json() == JSON_ITEMS + JSON_LIVE
    assert response.headers["stream-next-offset"] == live_offsets[1]


def test_python_client_async_text_stream(
    server: ServerProcess, stream_path: str, client: httpx.Client
) -> None:
    """PROTOCOL.md 5.1 (create), 5.2 (append), 5.6 (catch-up read) and 5.8 (SSE live read of a
    text stream: multi-line data events) with the Python client's asyncio API."""
    url = server.stream_url(stream_path)

    async def scenario() -> tuple[list[StreamEvent[Any]], str, str]:
        handle = await AsyncDurableStream.create(url, content_type="text/plain", timeout=TIMEOUT)
        try:
            assert handle.content_type is not None
            assert handle.content_type.startswith("text/plain")
            offsets = [(await handle.append(chunk)).next_offset for chunk in TEXT_CHUNKS]
            assert offsets == sorted(set(offsets)), offsets

            async with astream(url, offset="-1", live=False, timeout=TIMEOUT) as res:
                assert await res.read_text() == "".join(TEXT_CHUNKS)
                assert (res.offset, res.up_to_date) == (offsets[-1], True)
                tail = res.offset

            # The live read starts at the tail: the server's first control event says "up to
            # date", and only then is the text appended.
            async with astream(url, offset=tail, live="sse", timeout=TIMEOUT) as res:
                received: list[StreamEvent[Any]] = []

                async def read_live() -> None:
                    # iter_events holds each data event until its control event (offset).
                    async for event in res.iter_events(mode="text"):
                        received.append(event)
                        if "".join(e.data for e in received) == TEXT_LIVE:
                            return

                reader = asyncio.create_task(read_live())
                async with asyncio.timeout(TIMEOUT):
                    while not res.up_to_date:
                        assert not reader.done(), reader
                        await asyncio.sleep(0.01)
                assert received == []
                live_offset = (await handle.append(TEXT_LIVE)).next_offset
                await asyncio.wait_for(reader, TIMEOUT)
            return received, tail, live_offset
        finally:
            await handle.aclose()

    received, tail, live_offset = asyncio.run(scenario())
    assert "".join(event.data for event in received) == TEXT_LIVE
    assert (received[-1].next_offset, received[-1].up_to_date) == (live_offset, True)
    assert tail < live_offset

    response = client.get(url, params={"offset": "-1"})
    assert response.status_code == 200
    assert response.text == "".join(TEXT_CHUNKS) + TEXT_LIVE
    assert response.headers["stream-next-offset"] == live_offset
