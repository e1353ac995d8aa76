"""Materialization keeps up: State Protocol appends to a registered state stream vs. to a plain
JSON stream. Starts nothing itself.

Usage: python bench/state_bench.py BASE_URL [--producers 16] [--batches 60]

16 idempotent producers each append batches of 100 state events (inserts, updates and deletes
over a few thousand keys) to one stream; printed: events/s on an unregistered JSON stream, on
a registered one (schema-validated on append, materialized by the server right after), the
ratio, and how far materialization lagged: the time from the last acknowledged append until
the materialized offset reached the tail (read without forcing a catch-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid

import aiohttp
from common import producer_headers

BATCH = 100
# A benchmark whose state never catches up is a failure to report, not to wait out.
CATCH_UP_LIMIT_SECS = 60
SCHEMAS = {
    "user": {
        "type": "object",
        "required": ["name", "score"],
        "properties": {"name": {"type": "string"}, "score": {"type": "integer"}},
    }
}


def batch_body(producer: int, batch: int) -> bytes:
    rng = random.Random(producer * 100_003 + batch)
    events = []
    for i in range(BATCH):
        key = f"user-{rng.randrange(5000)}"
        if rng.random() < 0.1:
            events.append({"type": "user", "key": key, "headers": {"operation": "delete"}})
        else:
            operation = "insert" if rng.random() < 0.5 else "update"
            value = {"name": f"p{producer}-b{batch}-{i}", "score": rng.randrange(1000)}
            events.append(
                {"type": "user", "key": key, "value": value, "headers": {"operation": operation}}
            )
    return json.dumps(events).encode()


async def run(session: aiohttp.ClientSession, url: str, producers: int, batches: int) -> float:
    bodies = {(p, b): batch_body(p, b) for p in range(producers) for b in range(batches)}

    async def producer(index: int) -> None:
        for seq in range(batches):
            headers = producer_headers("application/json", f"p{index}", seq)
            async with session.post(url, data=bodies[(index, seq)], headers=headers) as response:
                if response.status != 200:
                    raise RuntimeError(
                        f"append answered {response.status}: {await response.text()}"
                    )

    start = time.perf_counter()
    await asyncio.gather(*(producer(i) for i in range(producers)))
    return producers * batches * BATCH / (time.perf_counter() - start)


async def materialized_offset(session: aiohttp.ClientSession, base: str, path: str) -> str:
    """How far the background materializer has got with ``path``. The registration list does
    not catch up (the detail and entity views would), so it shows the materializer's own
    progress; its pages are followed until the stream turns up."""
    url: str | None = f"{base}/v1/state/streams?page_size=1000"
    while url is not None:
        async with session.get(url) as response:
            listing = await response.json()
        for entry in listing["results"]:
            if entry["stream"] == path:
                return entry["materialized_offset"]
        url = listing["next"]
    raise SystemExit(f"{path} is not registered")


async def report_lag(
    session: aiohttp.ClientSession, base: str, path: str, url: str, started: float
) -> None:
    finished = time.perf_counter()
    async with session.head(url) as response:
        tail = response.headers["Stream-Next-Offset"]
    deadline = finished + CATCH_UP_LIMIT_SECS
    while await materialized_offset(session, base, path) < tail:
        if time.perf_counter() > deadline:
            raise SystemExit(f"{path} not materialized {CATCH_UP_LIMIT_SECS} s after its tail")
        await asyncio.sleep(0.01)
    caught_up = time.perf_counter()
    events = int(tail.split("_")[0])
    print(f"materialized: {events / (caught_up - started):9.0f} events/s; caught up "
          f"{(caught_up - finished) * 1000:.0f} ms after the last append")  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("--producers", type=int, default=16)
    parser.add_argument("--batches", type=int, default=60)
    args = parser.parse_args()
    base = args.base_url.rstrip("/")
    run_id = uuid.uuid4().hex[:8]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        rates = {}
        for label in ("plain", "registered"):
            path = f"bench-state-{run_id}/{label}"
            url = f"{base}/v1/stream/{path}"
            async with session.put(url, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 201, r.status
            if label == "registered":
                body = {"stream": path, "schemas": SCHEMAS}
                async with session.post(f"{base}/v1/state/streams", json=body) as r:
                    assert r.status == 201, await r.text()
            started = time.perf_counter()
            rates[label] = await run(session, url, args.producers, args.batches)
            print(f"{label:10s} JSON stream: {rates[label]:9.0f} events/s "
                  f"({args.producers} producers x {args.batches} batches of {BATCH})")  # fmt: skip
            if label == "registered":
                await report_lag(session, base, path, url, started)
        async with session.get(
            f"{base}/v1/state/entities", params={"stream": f"bench-state-{run_id}/registered"}
        ) as r:
            entities = (await r.json())["count"]
        print(f"registered / plain: {rates['registered'] / rates['plain']:.2f}"
              f"   ({entities} entities materialized)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
