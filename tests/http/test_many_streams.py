"""Many clients appending concurrently to many streams (group commit across streams, issue 10):
every stream holds exactly what was acknowledged, each client's appends in the order it made
them, nothing lost, nothing twice. No timing is asserted."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from typing import Any

import aiohttp

STREAMS = 120
CLIENTS = 48
APPENDS_PER_CLIENT = 60


def test_concurrent_appends_to_many_streams(server: Any) -> None:
    base = f"/v1/stream/many/{time.time_ns()}"
    paths = [f"{base}/s{n}" for n in range(STREAMS)]
    acknowledged: dict[str, list[str]] = defaultdict(list)

    async def scenario() -> dict[str, str]:
        connector = aiohttp.TCPConnector(limit=CLIENTS)
        async with aiohttp.ClientSession(base_url=server.base_url, connector=connector) as http:
            for path in paths:
                async with http.put(path, headers={"Content-Type": "text/plain"}) as response:
                    assert response.status == 201

            async def client(number: int) -> None:
                rng = random.Random(number)
                for n in range(APPENDS_PER_CLIENT):
                    path = rng.choice(paths)
                    message = f"c{number}.{n};"
                    headers = {"Content-Type": "text/plain"}
                    async with http.post(path, data=message, headers=headers) as response:
                        assert response.status == 204, await response.text()
                    acknowledged[path].append(message)

            await asyncio.gather(*(client(number) for number in range(CLIENTS)))
            stored = {}
            for path in paths:
                async with http.get(path, params={"offset": "-1"}) as response:
                    stored[path] = await response.text()
            return stored

    stored = asyncio.run(scenario())
    total = 0
    for path in paths:
        messages = [m + ";" for m in stored[path].split(";") if m]
        assert sorted(messages) == sorted(acknowledged[path]), path  # no loss, no duplicate
        total += len(messages)
        # Each client's appends to this stream, in the order the client made them.
        by_client: dict[str, list[int]] = defaultdict(list)
        for message in messages:
            who, n = message[1:-1].split(".")
            by_client[who].append(int(n))
        assert all(ns == sorted(ns) for ns in by_client.values()), path
    assert total == CLIENTS * APPENDS_PER_CLIENT
