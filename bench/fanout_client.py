"""SSE subscribers for compare.py's fan-out workload, in a process of their own so that their
parsing does not delay the writer's clock in the parent (and so their CPU time can be told
apart from it).

Usage: python bench/fanout_client.py URL OFFSET SUBSCRIBERS MESSAGES OUT_PATH TIMEOUT_SECS

Opens SUBSCRIBERS SSE readers of URL from OFFSET (aiohttp, as the other benchmarks), prints
``ready`` once every one has its 200 response, then records when each reader receives each of
up to MESSAGES records ``<tag>#<seq>|`` (``time.monotonic()``, which is system-wide, so the
parent can subtract its own send times). The parent writes the number of records it appended
to standard input when it is done. Stops when every reader has every one of those, or
TIMEOUT_SECS after ``ready``. Writes the arrival times to OUT_PATH as an array of doubles,
reader-major (0.0 where nothing arrived), and prints a JSON summary on its last line.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

import aiohttp

RECORD = re.compile(rb"#(\d{7})\|")


class Subscribers:
    def __init__(self, subscribers: int, messages: int) -> None:
        self.subscribers = subscribers
        self.messages = messages
        self.arrivals = array.array("d", bytes(8 * subscribers * messages))
        self.received = [0] * subscribers
        self.target = messages  # lowered to what the writer managed, once it says
        self.done = asyncio.Event()

    def check_done(self) -> None:
        if all(count >= self.target for count in self.received):
            self.done.set()

    async def read(self, index: int, response: aiohttp.ClientResponse) -> None:
        base, rest = index * self.messages, b""
        async for chunk in response.content.iter_any():
            now = time.monotonic()
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            for match in RECORD.finditer(data, 0, cut):
                seq = int(match.group(1))
                if seq < self.messages and self.arrivals[base + seq] == 0.0:
                    self.arrivals[base + seq] = now
                    self.received[index] += 1
            if self.received[index] >= self.target:
                self.check_done()
                if self.received[index] >= self.messages:
                    break

    async def writer_count(self) -> None:
        stdin = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(stdin)
        await asyncio.get_running_loop().connect_read_pipe(lambda: protocol, sys.stdin)
        line = await stdin.readline()
        if line.strip():
            self.target = int(line)
            self.check_done()


async def main(url: str, offset: str, subscribers: int, messages: int, out: str, timeout: float):
    state = Subscribers(subscribers, messages)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        headers={"Accept-Encoding": "identity"}
        | (
            {"Authorization": os.environ["DS_BENCH_AUTHORIZATION"]}
            if os.environ.get("DS_BENCH_AUTHORIZATION")
            else {}
        ),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=None, sock_connect=30),
    )
    gate = asyncio.Semaphore(50)  # connect in waves, not 1,000 SYNs at once

    async def connect() -> aiohttp.ClientResponse:
        async with gate:
            response = await session.get(url, params={"offset": offset, "live": "sse"})
            if response.status != 200:
                raise RuntimeError(f"SSE subscribe answered {response.status}")
            return response

    responses = await asyncio.gather(*(connect() for _ in range(subscribers)))
    cpu_start = resource.getrusage(resource.RUSAGE_SELF)
    tasks = [asyncio.create_task(state.read(i, r)) for i, r in enumerate(responses)]
    listener = asyncio.create_task(state.writer_count())
    print("ready", flush=True)
    started = time.monotonic()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.done.wait(), timeout)
    wall = time.monotonic() - started
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for response in responses:
        response.close()
    await session.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_bytes(state.arrivals.tobytes())  # noqa: ASYNC240 - once, at the end
    print(
        json.dumps(
            {
                "subscribers": subscribers,
                "received": sum(state.received),
                "expected": subscribers * state.target,
                "cpu_s": usage.ru_utime + usage.ru_stime - cpu_start.ru_utime - cpu_start.ru_stime,
                "wall_s": wall,
            }
        ),
        flush=True,
    )
    listener.cancel()


if __name__ == "__main__":
    url, offset, subscribers, messages, out, timeout = sys.argv[1:7]
    coroutine = main(url, offset, int(subscribers), int(messages), out, float(timeout))
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)
