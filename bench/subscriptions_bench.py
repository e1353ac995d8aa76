"""Benchmark of subscriptions (PROTOCOL.md 6, 7) against a running server. Starts nothing but
its own webhook receiver (an aiohttp server on 127.0.0.1, in this process).

Usage: python bench/subscriptions_bench.py BASE_URL [--quick] [--streams N] [--rounds N]

The server must accept loopback webhooks: start it with
DS_SUBSCRIPTIONS__ALLOW_LOOPBACK_WEBHOOKS=true (docs/benchmarks.md has the command).

Prints:
* append-to-webhook latency p50/p99: one webhook subscription on one stream, one append at a
  time; from sending the append to its webhook arriving at the receiver (which answers
  {"done": true}), and from the append's acknowledgement;
* wakes per second for N subscribed streams (default 1,000): N webhook subscriptions, one per
  stream, and ROUNDS appends to every stream (64 in flight); wakes received per second until
  every subscription's last wake reported its stream's tail, and how many events each wake
  carried on average;
* the same N streams followed by ONE subscription (pattern ``**``): one wake in flight at a
  time, so each wake carries many events.

Every webhook's signature is checked against the server's JWKS (Ed25519, PROTOCOL.md 7.1),
off the clock. The client and the receiver share this process and the machine with the
server: figures are a lower bound on what the server does alone.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
import uuid
from collections import defaultdict
from typing import Any

import aiohttp
from aiohttp import web
from common import latency
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

TEXT = {"Content-Type": "text/plain"}


class Receiver:
    """Records every webhook (arrival time, body, raw bytes, signature) and answers done."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, dict[str, Any], bytes, str]] = []
        self.waiters: list[tuple[Any, asyncio.Future[None]]] = []
        self.url = ""

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/hook", self.hook)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/hook"
        return runner

    async def hook(self, request: web.Request) -> web.Response:
        raw = await request.read()
        arrived = time.perf_counter()
        body = json.loads(raw)
        self.arrivals.append((arrived, body, raw, request.headers.get("Webhook-Signature", "")))
        for waiter in list(self.waiters):
            predicate, future = waiter
            if not future.done() and predicate(body):
                future.set_result(None)
                self.waiters.remove(waiter)
        return web.json_response({"done": True})

    async def wait_for(self, predicate: Any, timeout: float = 60) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append((predicate, future))
        await asyncio.wait_for(future, timeout)


def verify(raw: bytes, header: str, jwks: dict[str, Any]) -> bool:
    fields = dict(part.split("=", 1) for part in header.split(","))
    key = next(k for k in jwks["keys"] if k["kid"] == fields["kid"])

    def decode(text: str) -> bytes:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))

    public = Ed25519PublicKey.from_public_bytes(decode(key["x"]))
    public.verify(decode(fields["ed25519"]), f"{fields['t']}.".encode() + raw)
    return True


class Bench:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, receiver: Receiver) -> None:
        self.base = base_url.rstrip("/")
        self.run = "subbench-" + uuid.uuid4().hex[:8]
        self.session = session
        self.receiver = receiver

    def stream(self, name: str) -> str:
        return f"{self.base}/v1/stream/{self.run}/{name}"

    async def subscribe(self, sub: str, **config: Any) -> None:
        body = {"type": "webhook", "webhook": {"url": self.receiver.url}} | config
        url = f"{self.base}/v1/stream/__ds/subscriptions/{sub}"
        async with self.session.put(url, json=body) as response:
            if response.status != 201:
                raise RuntimeError(f"subscription answered {response.status}: "
                                   f"{await response.text()}")  # fmt: skip

    async def append(self, url: str, data: bytes) -> str:
        async with self.session.post(url, data=data, headers=TEXT) as response:
            if response.status != 204:
                raise RuntimeError(f"append answered {response.status}")
            return response.headers["Stream-Next-Offset"]

    async def create(self, url: str) -> None:
        async with self.session.put(url, headers=TEXT) as response:
            assert response.status in (200, 201), response.status

    async def latency(self, samples: int) -> None:
        path = f"{self.run}/latency"
        await self.create(self.stream("latency"))
        await self.subscribe(f"{self.run}-latency", streams=[path])
        from_send, from_ack = [], []
        for index in range(samples + 10):
            sent = time.perf_counter()
            offset = await self.append(self.stream("latency"), b"x" * 100)
            acked = time.perf_counter()

            def reported(body: dict[str, Any], offset: str = offset) -> bool:
                return any(
                    s["path"] == path and s["tail_offset"] >= offset for s in body["streams"]
                )

            already = [a for a in self.receiver.arrivals if reported(a[1])]
            if not already:
                await self.receiver.wait_for(reported)
            arrived = next(a[0] for a in self.receiver.arrivals if reported(a[1]))
            if index >= 10:  # warm-up
                from_send.append((arrived - sent) * 1000)
                from_ack.append((arrived - acked) * 1000)
        print(f"append -> webhook, from sending the append:  {latency(from_send)}")
        print(f"append -> webhook, from its acknowledgement: {latency(from_ack)}")

    async def throughput(self, streams: int, rounds: int, *, one_subscription: bool) -> None:
        label = "one" if one_subscription else "many"
        names = [f"{label}/s{i}" for i in range(streams)]
        for batch in range(0, streams, 100):
            await asyncio.gather(*(self.create(self.stream(n)) for n in names[batch : batch + 100]))
        if one_subscription:
            await self.subscribe(f"{self.run}-{label}", pattern=f"{self.run}/{label}/**")
        else:
            for batch in range(0, streams, 50):
                await asyncio.gather(*(
                    self.subscribe(f"{self.run}-{label}-{i}", streams=[f"{self.run}/{n}"])
                    for i, n in enumerate(names[batch:batch + 50], start=batch)
                ))  # fmt: skip
        first = len(self.receiver.arrivals)
        tails: dict[str, str] = {}
        gate = asyncio.Semaphore(64)

        async def one(name: str) -> None:
            async with gate:
                offset = await self.append(self.stream(name), b"e" * 100)
                path = f"{self.run}/{name}"
                tails[path] = max(tails.get(path, ""), offset)

        start = time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*(one(name) for name in names))
        appended = time.perf_counter()
        latest: dict[str, str] = defaultdict(str)

        def caught_up() -> bool:
            for _, body, _, _ in self.receiver.arrivals[first:]:
                for s in body["streams"]:
                    if s["tail_offset"] > latest[s["path"]]:
                        latest[s["path"]] = s["tail_offset"]
            return all(latest[path] >= tail for path, tail in tails.items())

        while not caught_up():
            await asyncio.sleep(0.05)
            if time.perf_counter() - appended > 300:
                raise RuntimeError("the webhooks did not catch up within 300 s")
        arrivals = self.receiver.arrivals[first:]
        end = arrivals[-1][0]
        wakes = len(arrivals)
        events = streams * rounds
        subs = "one subscription over all" if one_subscription else "one subscription each"
        print(
            f"{streams} streams, {subs}, {events} appends: {wakes} wakes in"
            f" {end - start:.2f} s = {wakes / (end - start):,.0f} wakes/s"
            f" ({events / wakes:.1f} appends per wake; appends took {appended - start:.2f} s)"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args()
    if args.quick:
        args.streams, args.rounds, args.samples = 50, 2, 30
    receiver = Receiver()
    runner = await receiver.start()
    connector = aiohttp.TCPConnector(limit=128)
    async with aiohttp.ClientSession(connector=connector) as session:
        bench = Bench(args.base_url, session, receiver)
        await bench.latency(args.samples)
        await bench.throughput(args.streams, args.rounds, one_subscription=False)
        await bench.throughput(args.streams, args.rounds, one_subscription=True)
        async with session.get(f"{bench.base}/v1/stream/__ds/jwks.json") as response:
            jwks = await response.json(content_type=None)
        checked = sum(verify(raw, header, jwks) for _, _, raw, header in receiver.arrivals)
        print(f"signatures verified against the JWKS: {checked} of {len(receiver.arrivals)}")
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
