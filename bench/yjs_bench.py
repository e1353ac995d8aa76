"""Yjs benchmark against a running server. Starts nothing itself.

Usage: python bench/yjs_bench.py BASE_URL [--service bench]

Prints: update propagation between two clients (one POSTs lib0-framed Yjs updates, the other
follows with SSE; p50/p99); the time from the append that crosses the compaction threshold
(the server's YJS_COMPACTION_THRESHOLD_BYTES, 1 MiB by default) until the new snapshot is
served; and the initial sync of a fresh client to that document (snapshot discovery, snapshot,
updates since, applied with pycrdt), p50 over several runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import time
import uuid
from pathlib import Path

import aiohttp
from common import latency
from pycrdt import Doc, Text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from yjs.framing import frame, read_frames

OCTET = {"Content-Type": "application/octet-stream"}
# Compaction of the benchmark's updates is expected well within this.
COMPACTION_LIMIT_SECS = 30


class Writer:
    """A pycrdt document whose updates are collected for posting."""

    def __init__(self) -> None:
        self.doc = Doc()
        self.text = self.doc.get("text", type=Text)
        self.pending: list[bytes] = []
        self.doc.observe(lambda event: self.pending.append(event.update))

    def type(self, chars: str) -> bytes:
        self.text += chars
        body = b"".join(frame(u) for u in self.pending)
        self.pending.clear()
        return body


async def propagation(session: aiohttp.ClientSession, doc_url: str, samples: int) -> None:
    async with session.put(doc_url) as response:
        assert response.status in (200, 201)
    writer = Writer()
    reader = Doc()
    reader_text = reader.get("text", type=Text)
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def follow() -> None:
        params = {"offset": "-1", "live": "sse"}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        # A session of its own: a cancelled SSE read must not hand its connection back.
        async with (
            aiohttp.ClientSession() as own,
            own.get(doc_url, params=params, timeout=timeout) as response,
        ):
            event = b""
            data: list[bytes] = []
            async for raw in response.content:
                line = raw.rstrip(b"\n")
                if line.startswith(b"event:"):
                    event, data = line[6:].strip(), []
                elif line.startswith(b"data:"):
                    data.append(line[5:].strip())
                elif line == b"" and event == b"data" and data:
                    for update in read_frames(base64.b64decode(b"".join(data))):
                        reader.apply_update(update)
                    arrived.put_nowait(time.perf_counter())
                    event, data = b"", []

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    latencies = []
    for i in range(samples):
        body = writer.type(f"update {i};")
        started = time.perf_counter()
        async with session.post(doc_url, data=body, headers=OCTET) as response:
            assert response.status == 204, await response.text()
        latencies.append((await asyncio.wait_for(arrived.get(), 5) - started) * 1000)
    task.cancel()
    assert str(reader_text) == str(writer.text)
    print(f"update propagation A -> B (SSE), {samples} updates:  {latency(latencies)}")


async def concurrent_writes(
    session: aiohttp.ClientSession, doc_url: str, writers: int, posts: int
) -> None:
    """``writers`` clients typing into one document at once, one POST in flight each: the
    POSTs' round trip and the updates stored per second (each POST is checked against the
    whole document, and one process checks one POST of a document at a time)."""
    async with session.put(doc_url) as response:
        assert response.status in (200, 201)
    latencies: list[float] = []

    async def write(writer: Writer) -> None:
        for i in range(posts):
            body = writer.type(f"w{i} ")
            started = time.perf_counter()
            async with session.post(doc_url, data=body, headers=OCTET) as response:
                assert response.status == 204, await response.text()
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(write(Writer()) for _ in range(writers)))
    elapsed = time.perf_counter() - started
    print(
        f"{writers} writers on one document, {posts} POSTs each: {len(latencies) / elapsed:,.0f}"
        f" updates/s   POST {latency(latencies)}"
    )


async def snapshot_location(session: aiohttp.ClientSession, doc_url: str) -> str:
    async with session.get(doc_url, params={"offset": "snapshot"}, allow_redirects=False) as r:
        return r.headers["Location"]


async def compaction(session: aiohttp.ClientSession, doc_url: str, megabytes: float) -> Writer:
    writer = Writer()
    target = int(megabytes * 1024 * 1024)
    written = 0
    # ~1 MiB of typing: many small updates, posted in batches of 50 (as a provider batches).
    batches: list[bytes] = []
    while written < target:
        body = b"".join(writer.type(f"word{written % 997} ") for _ in range(50))
        batches.append(body)
        written += len(body)
    # (Created after generating the updates: an idle keep-alive connection would have been
    # closed by the server meanwhile.)
    async with session.put(doc_url) as response:
        assert response.status in (200, 201)
    for body in batches[:-1]:
        async with session.post(doc_url, data=body, headers=OCTET) as response:
            assert response.status == 204
    before = await snapshot_location(session, doc_url)
    started = time.perf_counter()
    async with session.post(doc_url, data=batches[-1], headers=OCTET) as response:
        assert response.status == 204
    deadline = started + COMPACTION_LIMIT_SECS
    while await snapshot_location(session, doc_url) == before:
        if time.perf_counter() > deadline:
            raise SystemExit(
                f"no new snapshot {COMPACTION_LIMIT_SECS} s after {written} bytes of updates:"
                " is the server's YJS_COMPACTION_THRESHOLD_BYTES above that?"
            )
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    print(
        f"compaction of {written / 1048576:.2f} MiB of updates ({len(batches) * 50} updates): "
        f"snapshot served {elapsed * 1000:.0f} ms after the crossing append"
    )
    return writer


async def initial_sync(
    session: aiohttp.ClientSession, doc_url: str, expected: str, runs: int
) -> None:
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        doc = Doc()
        text = doc.get("text", type=Text)
        location = await snapshot_location(session, doc_url)
        base = doc_url.split("/v1/")[0]
        async with session.get(base + location) as response:
            assert response.status == 200
            doc.apply_update(await response.read())
            offset = response.headers["Stream-Next-Offset"]
        while True:
            async with session.get(doc_url, params={"offset": offset}) as response:
                for update in read_frames(await response.read()):
                    doc.apply_update(update)
                offset = response.headers["Stream-Next-Offset"]
                if response.headers.get("Stream-Up-To-Date") == "true":
                    break
        timings.append((time.perf_counter() - started) * 1000)
        assert str(text) == expected
    print(
        f"initial sync after compaction (snapshot + updates since, pycrdt): "
        f"p50 {statistics.median(timings):6.1f} ms   max {max(timings):6.1f} ms ({runs} runs)"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("--service", default="bench")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--megabytes", type=float, default=1.0)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--posts", type=int, default=100)
    args = parser.parse_args()
    run = uuid.uuid4().hex[:8]
    docs = f"{args.base_url.rstrip('/')}/v1/yjs/{args.service}/docs/{run}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        print(f"server: {args.base_url}")
        await propagation(session, f"{docs}/propagation", args.samples)
        await concurrent_writes(session, f"{docs}/writers", args.writers, args.posts)
        writer = await compaction(session, f"{docs}/compaction", args.megabytes)
        await initial_sync(session, f"{docs}/compaction", str(writer.text), runs=10)


if __name__ == "__main__":
    asyncio.run(main())
