"""SSE subscribers for compare.py's fan-out workload, in a process of their own so that their
parsing does not delay the writer's clock in the parent (and so their CPU time can be told
apart from it).

Usage: python bench/fanout_client.py URL OFFSET SUBSCRIBERS MESSAGES OUT_PATH TIMEOUT_SECS

Opens SUBSCRIBERS SSE readers of URL from OFFSET (aiohttp, as the other benchmarks), prints
``ready`` once every one has its 200 response, then records when each reader receives each of
the MESSAGES records ``<tag>#<seq>|`` (``time.monotonic()``, which is system-wide, so the parent
can subtract its own send times). Stops when every reader has every record, or TIMEOUT_SECS
after ``ready``. Writes the arrival times to OUT_PATH as an array of doubles, reader-major (0.0
where nothing arrived), and prints a JSON summary on its last line.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import re
import resource
import sys
import time
from pathlib import Path

import aiohttp

RECORD = re.compile(rb"#(\d{7})\|")


async def main(url: str, offset: str, subscribers: int, messages: int, out: str, timeout: float):
    arrivals = array.array("d", bytes(8 * subscribers * messages))
    received = [0] * subscribers
    done = asyncio.Event()
    complete = 0
    connector = aiohttp.TCPConnector(limit=0)
    session = aiohttp.ClientSession(
        connector=connector,
        headers={"Accept-Encoding": "identity"},
        timeout=aiohttp.ClientTimeout(total=None, sock_read=None, sock_connect=30),
    )
    responses: list[aiohttp.ClientResponse] = []
    gate = asyncio.Semaphore(50)  # connect in waves, not 1,000 SYNs at once

    async def connect() -> aiohttp.ClientResponse:
        async with gate:
            response = await session.get(url, params={"offset": offset, "live": "sse"})
            if response.status != 200:
                raise RuntimeError(f"SSE subscribe answered {response.status}")
            return response

    async def reader(index: int, response: aiohttp.ClientResponse) -> None:
        nonlocal complete
        base = index * messages
        rest = b""
        count = 0
        async for chunk in response.content.iter_any():
            now = time.monotonic()
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            for match in RECORD.finditer(data, 0, cut):
                seq = int(match.group(1))
                if seq < messages and arrivals[base + seq] == 0.0:
                    arrivals[base + seq] = now
                    count += 1
            if count >= messages:
                break
        received[index] = count
        response.close()
        if count >= messages:
            complete += 1
            if complete == subscribers:
                done.set()

    cpu_start = resource.getrusage(resource.RUSAGE_SELF)
    responses = await asyncio.gather(*(connect() for _ in range(subscribers)))
    tasks = [asyncio.create_task(reader(i, r)) for i, r in enumerate(responses)]
    print("ready", flush=True)
    started = time.monotonic()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), timeout)
    wall = time.monotonic() - started
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for i, r in enumerate(responses):
        if not received[i]:
            received[i] = sum(1 for s in range(messages) if arrivals[i * messages + s])
        r.close()
    await session.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_bytes(arrivals.tobytes())  # noqa: ASYNC240 - once, at the end
    print(
        json.dumps(
            {
                "subscribers": subscribers,
                "complete": complete,
                "received": sum(received),
                "expected": subscribers * messages,
                "cpu_s": usage.ru_utime + usage.ru_stime - cpu_start.ru_utime - cpu_start.ru_stime,
                "wall_s": wall,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    url, offset, subscribers, messages, out, timeout = sys.argv[1:7]
    coroutine = main(url, offset, int(subscribers), int(messages), out, float(timeout))
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)
