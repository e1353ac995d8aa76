"""Materializing 1,000,000 State Protocol events: Spark (local[*]) against the in-process
materializer.

Usage: python bench/spark_bench.py BASE_URL [--events 1000000] [--master local[*]]

Appends the events to a new JSON stream through the server at BASE_URL (16 producers), then:
* in-process: registers the stream (POST /v1/state/streams), which rebuilds its state from
  the whole history in the server, and times it;
* Spark: runs ``manage.py spark_materialize --stream PATH`` (against the same database as the
  server: set DATABASE_URL as the server has it, or leave both unset for the local cluster),
  timing the whole command and its session start-up (its "spark: session ready" line).
Prints events/s for each, and the Spark start-up overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BATCH = 1000
TYPES = ["user", "order", "item", "session", "flag", "team", "note", "task"]


def batch(index: int, size: int) -> bytes:
    rng = random.Random(index)
    producer = index % 16
    events = []
    for i in range(size):
        entity_type = rng.choice(TYPES)
        key = f"{entity_type}-{rng.randrange(20_000)}"
        if rng.random() < 0.1:
            events.append({"type": entity_type, "key": key, "headers": {"operation": "delete"}})
        else:
            value = {
                "n": i,
                "p": producer,
                "label": f"{entity_type} {index}",
                "score": rng.random(),
            }
            operation = "update" if rng.random() < 0.6 else "insert"
            events.append(
                {
                    "type": entity_type,
                    "key": key,
                    "value": value,
                    "headers": {"operation": operation},
                }
            )
    return json.dumps(events).encode()


async def generate(base: str, path: str, events: int, producers: int = 16) -> float:
    url = f"{base}/v1/stream/{path}"
    # Batch n holds events n*BATCH onwards; the last one may be short. Producer p sends the
    # batches p, p + producers, ... in order.
    sizes = [min(BATCH, events - start) for start in range(0, events, BATCH)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.put(url, headers={"Content-Type": "application/json"}) as response:
            assert response.status == 201, response.status

        async def producer(index: int) -> None:
            for n in range(index, len(sizes), producers):
                headers = {"Content-Type": "application/json"}
                body = batch(n, sizes[n])
                async with session.post(url, data=body, headers=headers) as response:
                    assert response.status == 204, await response.text()

        started = time.perf_counter()
        await asyncio.gather(*(producer(i) for i in range(producers)))
        return time.perf_counter() - started


async def register(base: str, path: str) -> float:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        async with session.post(f"{base}/v1/state/streams", json={"stream": path}) as response:
            assert response.status == 201, await response.text()
            await response.read()
        return time.perf_counter() - started


def spark(path: str, master: str) -> tuple[float, float, str]:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "manage.py", "spark_materialize", "--stream", path, "--master", master],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - started
    ready = re.search(r"spark: session ready in ([\d.]+)s", result.stdout)
    return elapsed, float(ready.group(1)) if ready else float("nan"), result.stdout


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[*]")
    args = parser.parse_args()
    base = args.base_url.rstrip("/")
    path = f"bench-spark-{uuid.uuid4().hex[:8]}"

    generated = await generate(base, path, args.events)
    events = args.events
    print(f"generated {events} events in {generated:.1f}s ({events / generated:.0f} events/s)")

    in_process = await register(base, path)
    print(f"in-process materializer (registration backfill): {in_process:.1f}s, "
          f"{events / in_process:.0f} events/s")  # fmt: skip

    total, startup, output = spark(path, args.master)
    job = total - startup
    print(f"spark ({args.master}): {total:.1f}s in all, {startup:.1f}s of it session start-up; "
          f"{events / total:.0f} events/s overall, "
          f"{events / job:.0f} events/s after start-up")  # fmt: skip
    for line in output.splitlines():
        if line.startswith(("read:", "compute:", "write:", "publish:")):
            print(f"  {line}")


if __name__ == "__main__":
    asyncio.run(main())
