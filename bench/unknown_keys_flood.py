"""What a flood of made-up API keys costs a legitimate client (docs/reliability.md).

One client appends 100 B to its own stream, one request at a time, first alone and then while
FLOODERS connections send HEADs with made-up keys (a new key id each, as an attacker who wants
lookups would), as fast as the server answers them. Prints the legitimate client's p50 and p90
in both phases, how many made-up requests were answered, and their statuses. Against a server
in keys mode on 127.0.0.1; KEY must be a key that may create and append under bench/flood/.

Usage: .venv/bin/python bench/unknown_keys_flood.py BASE_URL KEY [--seconds S] [--flooders N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import secrets
import statistics
import string
import time

import aiohttp

ALPHABET = string.ascii_letters + string.digits


async def legitimate(
    http: aiohttp.ClientSession, url: str, key: str, seconds: float
) -> list[float]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/octet-stream"}
    times = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        async with http.post(url, data=b"." * 100, headers=headers) as response:
            assert response.status == 204, response.status
        times.append((time.perf_counter() - start) * 1000)
    return times


async def flooder(
    http: aiohttp.ClientSession, url: str, stop: asyncio.Event, statuses: collections.Counter[int]
) -> None:
    while not stop.is_set():
        made_up = "".join(secrets.choice(ALPHABET) for _ in range(8)) + "." + "x" * 32
        async with http.head(url, headers={"Authorization": f"Bearer {made_up}"}) as response:
            statuses[response.status] += 1


def summary(times: list[float]) -> str:
    quantiles = statistics.quantiles(times, n=10)
    return f"{len(times)} appends, p50 {statistics.median(times):.2f} ms, p90 {quantiles[8]:.2f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_url")
    parser.add_argument("key")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--flooders", type=int, default=32)
    args = parser.parse_args()
    url = f"{args.base_url.rstrip('/')}/v1/stream/bench/flood/{time.time_ns()}"
    connector = aiohttp.TCPConnector(limit=args.flooders + 4)
    async with aiohttp.ClientSession(connector=connector) as http:
        headers = {
            "Authorization": f"Bearer {args.key}",
            "Content-Type": "application/octet-stream",
        }
        async with http.put(url, headers=headers) as response:
            assert response.status == 201, response.status
        alone = await legitimate(http, url, args.key, args.seconds)
        stop, statuses = asyncio.Event(), collections.Counter[int]()
        flood = [
            asyncio.create_task(flooder(http, url, stop, statuses)) for _ in range(args.flooders)
        ]
        during = await legitimate(http, url, args.key, args.seconds)
        stop.set()
        await asyncio.gather(*flood)
        async with http.delete(url, headers=headers) as response:
            assert response.status == 204, response.status
    print(f"alone:  {summary(alone)}")
    print(f"during: {summary(during)}")
    total = sum(statuses.values())
    print(f"made-up keys: {total} requests ({total / args.seconds:,.0f}/s), {dict(statuses)}")


if __name__ == "__main__":
    asyncio.run(main())
