"""Live delivery across server processes (DESIGN.md, Live delivery; PROTOCOL.md 5.7, 5.8).

Two server processes share one database. Readers connected to process 1 must be woken by an
append made through process 2: the append's NOTIFY reaches process 1's LISTEN connection.
The 100 ms bound separates notification-driven delivery from any polling or timeout path (the
test servers' long-poll timeout is 2 s); it is the issue's stated requirement.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

DELIVERY_BOUND_SECONDS = 0.100


@pytest.fixture(scope="module")
def two_servers(start_server: Any) -> tuple[Any, Any]:
    return start_server(), start_server()


async def _sse_events(
    client: httpx.AsyncClient, url: str, offset: str, queue: asyncio.Queue
) -> None:
    async with client.stream("GET", url, params={"offset": offset, "live": "sse"}) as response:
        assert response.status_code == 200
        event = None
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                queue.put_nowait((event, line[5:], time.perf_counter()))


def test_readers_on_one_process_see_appends_through_another(two_servers: tuple[Any, Any]) -> None:
    """PROTOCOL.md 5.7 and 5.8: a long-poll and an SSE reader on process 1 receive an append
    made through process 2 within 100 ms, several times in a row."""
    first, second = two_servers

    async def scenario() -> None:
        url_1 = first.stream_url(f"multiprocess/{time.time_ns()}")
        url_2 = url_1.replace(first.base_url, second.base_url)
        async with httpx.AsyncClient(timeout=10) as client:
            created = await client.put(url_1, headers={"Content-Type": "text/plain"})
            assert created.status_code == 201
            offset = created.headers["Stream-Next-Offset"]
            events: asyncio.Queue = asyncio.Queue()
            sse_task = asyncio.create_task(_sse_events(client, url_1, offset, events))
            # The SSE reader is subscribed once its first control event arrives.
            kind, _, _ = await asyncio.wait_for(events.get(), 5)
            assert kind == "control"

            for round_number in range(5):
                body = f"message {round_number}"
                poll = asyncio.create_task(
                    client.get(url_1, params={"offset": offset, "live": "long-poll"})
                )
                await asyncio.sleep(0.2)  # the long-poll is waiting on process 1
                sent_at = time.perf_counter()
                appended = await client.post(
                    url_2, content=body, headers={"Content-Type": "text/plain"}
                )
                assert appended.status_code == 204

                answer = await asyncio.wait_for(poll, 5)
                polled_at = time.perf_counter()
                assert answer.status_code == 200
                assert answer.text == body
                offset = answer.headers["Stream-Next-Offset"]
                assert offset == appended.headers["Stream-Next-Offset"]

                kind, data, received_at = await asyncio.wait_for(events.get(), 5)
                assert (kind, data) == ("data", body)
                kind, control, _ = await asyncio.wait_for(events.get(), 5)
                assert kind == "control" and offset in control

                assert polled_at - sent_at < DELIVERY_BOUND_SECONDS, polled_at - sent_at
                assert received_at - sent_at < DELIVERY_BOUND_SECONDS, received_at - sent_at
            sse_task.cancel()

    asyncio.run(scenario())


def test_close_and_delete_wake_readers_on_other_process(two_servers: tuple[Any, Any]) -> None:
    """PROTOCOL.md 5.7 / 5.4: closing through process 2 ends a long-poll on process 1 with
    Stream-Closed; deleting ends an SSE connection on process 1."""
    first, second = two_servers

    async def scenario() -> None:
        path = f"multiprocess/close-{time.time_ns()}"
        async with httpx.AsyncClient(timeout=10) as client:
            created = await client.put(
                first.stream_url(path), headers={"Content-Type": "text/plain"}
            )
            offset = created.headers["Stream-Next-Offset"]
            poll = asyncio.create_task(
                client.get(first.stream_url(path), params={"offset": offset, "live": "long-poll"})
            )
            await asyncio.sleep(0.2)
            closed = await client.post(second.stream_url(path), headers={"Stream-Closed": "true"})
            assert closed.status_code == 204
            answer = await asyncio.wait_for(poll, 1.5)  # well before the 2 s long-poll timeout
            assert answer.status_code == 204
            assert answer.headers["Stream-Closed"] == "true"

            other = f"multiprocess/delete-{time.time_ns()}"
            await client.put(first.stream_url(other), headers={"Content-Type": "text/plain"})
            events: asyncio.Queue = asyncio.Queue()
            reader = asyncio.create_task(_sse_events(client, first.stream_url(other), "-1", events))
            await asyncio.wait_for(events.get(), 5)
            deleted = await client.delete(second.stream_url(other))
            assert deleted.status_code == 204
            await asyncio.wait_for(reader, 1.5)  # the event stream ended

    asyncio.run(scenario())
