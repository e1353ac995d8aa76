"""Exactly-once appends from concurrent idempotent producers (PROTOCOL.md 5.2.1, 8).

16 producers append 500 messages each to one stream, each also retrying some of its own
requests: sometimes a second copy races the first, sometimes the request is sent again after
its answer (as after a lost response). Every acknowledged message must be stored exactly once,
each producer's messages in its own order, and offsets must strictly increase.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx

PRODUCERS = 16
MESSAGES = 500


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]  # case-insensitive
    text: str


async def _producer(
    client: aiohttp.ClientSession, url: str, index: int, acks: dict[tuple[int, int], str]
) -> None:
    for seq in range(MESSAGES):
        headers = {
            "Content-Type": "application/json",
            "Producer-Id": f"producer-{index}",
            "Producer-Epoch": "0",
            "Producer-Seq": str(seq),
        }
        body = json.dumps({"p": index, "s": seq})

        async def send(headers: dict[str, str] = headers, body: str = body) -> Answer:
            async with client.post(url, data=body, headers=headers) as response:
                return Answer(response.status, response.headers.copy(), await response.text())

        if seq % 7 == 3:
            # A retry racing the original: exactly one of them stores the message.
            responses = await asyncio.gather(send(), send())
            assert sorted(r.status for r in responses) == [200, 204], responses
        else:
            responses = [await send()]
            assert responses[0].status == 200, responses[0].text
        if seq % 11 == 5:
            # A retry after a lost answer: a duplicate, reporting the highest accepted seq.
            again = await send()
            assert again.status == 204
            assert int(again.headers["Producer-Seq"]) >= seq
        accepted = next(r for r in responses if r.status == 200)
        assert accepted.headers["Producer-Seq"] == str(seq)
        acks[(index, seq)] = accepted.headers["Stream-Next-Offset"]


def test_concurrent_producers_with_retries_store_each_message_once(server: Any) -> None:
    url = server.stream_url(f"producers/exactly-once-{time.time_ns()}")

    async def scenario() -> dict[tuple[int, int], str]:
        connector = aiohttp.TCPConnector(limit=64)
        async with aiohttp.ClientSession(connector=connector) as client:
            async with client.put(url, headers={"Content-Type": "application/json"}) as created:
                assert created.status == 201
            acks: dict[tuple[int, int], str] = {}
            await asyncio.gather(*(_producer(client, url, i, acks) for i in range(PRODUCERS)))
            return acks

    acks = asyncio.run(scenario())
    assert len(acks) == PRODUCERS * MESSAGES

    # Acknowledged offsets are unique and grow with each producer's sequence.
    assert len(set(acks.values())) == len(acks)
    for index in range(PRODUCERS):
        offsets = [acks[(index, seq)] for seq in range(MESSAGES)]
        assert offsets == sorted(offsets)

    # Read everything back, in chunks, checking the offsets move strictly forward.
    stored: list[dict[str, int]] = []
    offset = "-1"
    previous = ""
    with httpx.Client(timeout=30) as client:
        while True:
            response = client.get(url, params={"offset": offset})
            assert response.status_code == 200
            stored.extend(response.json())
            offset = response.headers["Stream-Next-Offset"]
            assert offset > previous
            previous = offset
            if response.headers.get("Stream-Up-To-Date") == "true":
                break

    assert len(stored) == PRODUCERS * MESSAGES
    assert len({(m["p"], m["s"]) for m in stored}) == len(stored), "a message was stored twice"
    for index in range(PRODUCERS):
        assert [m["s"] for m in stored if m["p"] == index] == list(range(MESSAGES))
    # Each acknowledgement's offset is exactly the position right after its message.
    final_offsets = sorted(acks.values())
    assert final_offsets[-1] == offset
