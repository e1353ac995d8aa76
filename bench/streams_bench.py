"""Benchmark of the base protocol against a running server. Starts nothing itself.

Usage: python bench/streams_bench.py BASE_URL [--quick] [--only sse,long-poll,...]

Prints: append RTT p50/p99; appends/s with 16 concurrent idempotent producers on one stream and
with each producer on its own stream (100-byte messages); 64 KiB append MB/s; SSE and long-poll
delivery latency p50/p99; catch-up read MB/s for a binary and a JSON stream.

The client is aiohttp on one event loop; it shares the machine with the server, so figures are
a lower bound on what the server does alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
from common import latency, producer_headers

MESSAGE = b"x" * 100


class Bench:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, scale: float) -> None:
        self.base = base_url.rstrip("/") + "/v1/stream/bench-" + uuid.uuid4().hex[:8]
        self.session = session
        self.scale = scale

    def n(self, count: int) -> int:
        return max(10, int(count * self.scale))

    async def create(self, name: str, content_type: str = "application/octet-stream") -> str:
        url = f"{self.base}/{name}"
        async with self.session.put(url, headers={"Content-Type": content_type}) as response:
            assert response.status in (200, 201), response.status
        return url

    async def append(self, url: str, body: bytes, headers: dict[str, str] | None = None) -> str:
        async with self.session.post(url, data=body, headers=headers) as response:
            if response.status not in (200, 204):
                raise RuntimeError(f"append answered {response.status}: {await response.text()}")
            return response.headers["Stream-Next-Offset"]

    async def append_rtt(self) -> None:
        url = await self.create("rtt")
        headers = {"Content-Type": "application/octet-stream"}
        for _ in range(20):
            await self.append(url, MESSAGE, headers)
        samples = []
        for _ in range(self.n(2000)):
            start = time.perf_counter()
            await self.append(url, MESSAGE, headers)
            samples.append((time.perf_counter() - start) * 1000)
        print(f"append RTT (1 client, 100 B):           {latency(samples)}")

    async def producers(self, label: str, same_stream: bool, producers: int = 16) -> None:
        per_producer = self.n(500)
        urls = (
            [await self.create("shared")] * producers
            if same_stream
            else [await self.create(f"own-{i}") for i in range(producers)]
        )

        async def producer(index: int) -> None:
            for seq in range(per_producer):
                headers = producer_headers("application/octet-stream", f"p{index}", seq)
                await self.append(urls[index], MESSAGE, headers)

        start = time.perf_counter()
        await asyncio.gather(*(producer(i) for i in range(producers)))
        elapsed = time.perf_counter() - start
        rate = producers * per_producer / elapsed
        print(f"{label:40s} {rate:8.0f} appends/s")

    async def large_appends(self) -> None:
        url = await self.create("large")
        body = b"y" * 65536
        headers = {"Content-Type": "application/octet-stream"}
        count = self.n(400)
        start = time.perf_counter()
        for _ in range(count):
            await self.append(url, body, headers)
        elapsed = time.perf_counter() - start
        print(f"64 KiB appends (1 client):              {count * 65536 / elapsed / 1e6:8.1f} MB/s")

    async def sse_latency(self) -> None:
        url = await self.create("sse", "text/plain")
        tail = await self.append(url, b"start", {"Content-Type": "text/plain"})
        samples: list[float] = []
        arrived: asyncio.Queue[float] = asyncio.Queue()

        async def reader() -> None:
            timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
            async with self.session.get(
                url, params={"offset": tail, "live": "sse"}, timeout=timeout
            ) as response:
                async for line in response.content:
                    if line.startswith(b"data:") and b"ping" in line:
                        arrived.put_nowait(time.perf_counter())

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.3)
        for _ in range(self.n(300)):
            start = time.perf_counter()
            await self.append(url, b"ping", {"Content-Type": "text/plain"})
            received = await asyncio.wait_for(arrived.get(), 5)
            samples.append((received - start) * 1000)
        task.cancel()
        print(f"SSE delivery (append -> event):         {latency(samples)}")

    async def long_poll_latency(self) -> None:
        url = await self.create("lp", "text/plain")
        offset = await self.append(url, b"start", {"Content-Type": "text/plain"})
        samples: list[float] = []
        for _ in range(self.n(300)):
            poll = asyncio.create_task(
                self.session.get(url, params={"offset": offset, "live": "long-poll"})
            )
            await asyncio.sleep(0.002)  # let the poll reach the server and wait
            start = time.perf_counter()
            await self.append(url, b"ping", {"Content-Type": "text/plain"})
            response = await poll
            await response.read()
            samples.append((time.perf_counter() - start) * 1000)
            assert response.status == 200, response.status
            offset = response.headers["Stream-Next-Offset"]
            response.release()
        print(f"long-poll delivery (append -> answer):  {latency(samples)}")

    async def catch_up(self, label: str, content_type: str, total_bytes: int) -> None:
        url = await self.create(f"catchup-{content_type.replace('/', '-')}", content_type)
        if content_type == "application/json":
            item = json.dumps({"value": "z" * 180}).encode()
            batch = b"[" + b",".join([item] * 500) + b"]"
        else:
            batch = b"z" * 100_000
        headers = {"Content-Type": content_type}
        written = 0
        while written < total_bytes:
            await self.append(url, batch, headers)
            written += len(batch)
        for _ in range(2):  # warm the cache, then measure
            received = 0
            start = time.perf_counter()
            offset = "-1"
            while True:
                async with self.session.get(url, params={"offset": offset}) as response:
                    received += len(await response.read())
                    offset = response.headers["Stream-Next-Offset"]
                    if response.headers.get("Stream-Up-To-Date") == "true":
                        break
            elapsed = time.perf_counter() - start
        print(f"{label:40s} {received / elapsed / 1e6:8.1f} MB/s ({received / 1e6:.0f} MB)")


MEASUREMENTS: dict[str, Callable[[Bench], Awaitable[None]]] = {
    "rtt": Bench.append_rtt,
    "producers": lambda bench: bench.producers("16 producers, one stream:", same_stream=True),
    "own-streams": lambda bench: bench.producers("16 producers, own streams:", same_stream=False),
    "large": Bench.large_appends,
    "sse": Bench.sse_latency,
    "long-poll": Bench.long_poll_latency,
    "catch-up-binary": lambda bench: bench.catch_up(
        "catch-up read, binary stream:", "application/octet-stream", 50_000_000
    ),
    "catch-up-json": lambda bench: bench.catch_up(
        "catch-up read, JSON stream:", "application/json", 50_000_000
    ),
}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("--quick", action="store_true", help="a tenth of the work, for a smoke run")
    parser.add_argument(
        "--only",
        default=",".join(MEASUREMENTS),
        help=f"comma-separated measurements to run (default: all of {','.join(MEASUREMENTS)})",
    )
    args = parser.parse_args()
    chosen = args.only.split(",")
    unknown = set(chosen) - set(MEASUREMENTS)
    if unknown:
        parser.error(f"unknown measurement(s): {', '.join(sorted(unknown))}")
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        bench = Bench(args.base_url, session, 0.1 if args.quick else 1.0)
        print(f"server: {args.base_url}")
        for name in MEASUREMENTS:
            if name in chosen:
                await MEASUREMENTS[name](bench)


if __name__ == "__main__":
    asyncio.run(main())
