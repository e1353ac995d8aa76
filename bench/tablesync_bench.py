"""Table sync: what publishing a table costs its writers, and how fast a stream is sunk.

Usage: DATABASE_URL=... python bench/tablesync_bench.py BASE_URL [--clients 16]
           [--seconds 10] [--bulk-rows 100000] [--sink-messages 100000] [--only writes,...]

BASE_URL is a running server on the database of DATABASE_URL (the tables are written straight
to it, as an application would; publishing and sinking use the management commands). Prints:

* writes: CLIENTS connections each committing single-row transactions (an INSERT of a new row
  or an UPDATE of one of 10,000 rows) for SECONDS: rows/s and commit latency on a plain table,
  then on the same table published, with an SSE reader of the stream counting the change
  events it receives and how long after the commit each arrives. The same with transactions
  of 100 rows (one INSERT statement).
* bulk: COPY of BULK_ROWS rows, then one UPDATE of all of them, on a plain and on a published
  table: the statement's time, the COMMIT's (the stream is locked from the start of the commit
  to its end), and the worst wait of a single-row writer of the same table during the bulk
  commit (what the stream lock costs other writers).
* sink: SINK_MESSAGES messages appended to a stream (batches of 1,000), then sunk (append
  mode, 4 columns, the table created by the sink): messages/s from binding until the sink
  reaches the tail; then 16 producers appending while the sink runs: appends/s, and how far
  behind the sink is when they stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from common import latency, producer_headers

ROOT = Path(__file__).resolve().parent.parent
KEYS = 10_000
JSON = {"Content-Type": "application/json"}


def manage(database_url: str, *args: str) -> str:
    env = {**os.environ, "DATABASE_URL": database_url}
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)}: {result.stderr}")
    return result.stdout


def stamp() -> str:
    return f"{time.strftime('%H%M%S')}_{random.randrange(10**6):06d}"


async def create_table(db: str, name: str) -> None:
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await conn.execute(
            f"CREATE TABLE {name} (id bigint PRIMARY KEY, owner text NOT NULL, qty int,"
            " note text, updated_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute(
            f"INSERT INTO {name} (id, owner, qty, note) SELECT g, 'seed', g % 100, 'seeded row'"
            f" FROM generate_series(1, {KEYS}) AS g"
        )
        await conn.execute(f"VACUUM ANALYZE {name}")


async def writers(
    db: str, table: str, clients: int, seconds: float, rows_per_txn: int
) -> tuple[int, list[float]]:
    """CLIENTS connections committing transactions for SECONDS; returns (rows, latencies ms)."""
    deadline = time.perf_counter() + seconds
    samples: list[float] = []
    counts = [0] * clients

    async def client(index: int) -> None:
        rng = random.Random(index)
        next_id = 1_000_000_000 + index * 10_000_000
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                if rows_per_txn == 1 and rng.random() < 0.5:
                    await conn.execute(
                        f"UPDATE {table} SET qty = qty + 1, updated_at = now() WHERE id = %s",
                        (rng.randrange(1, KEYS + 1),),
                    )
                else:
                    await conn.execute(
                        f"INSERT INTO {table} (id, owner, qty, note)"
                        " SELECT g, %s, 1, 'a new row written by a benchmark client'"
                        " FROM generate_series(%s::bigint, %s::bigint) AS g",
                        (f"client {index}", next_id, next_id + rows_per_txn - 1),
                    )
                    next_id += rows_per_txn
                samples.append((time.perf_counter() - started) * 1000)
                counts[index] += rows_per_txn

    await asyncio.gather(*(client(i) for i in range(clients)))
    return sum(counts), samples


class SseCounter:
    """Counts the events an SSE reader of a stream receives, and when."""

    def __init__(self, session: aiohttp.ClientSession, url: str, offset: str) -> None:
        self.session, self.url, self.offset = session, url, offset
        self.events = 0
        self.arrivals: list[tuple[float, int]] = []
        self.task: asyncio.Task[None] | None = None
        self.moved = asyncio.Event()

    async def start(self) -> None:
        self.task = asyncio.create_task(self._read())
        await asyncio.sleep(0.5)

    async def _read(self) -> None:
        while True:
            params = {"offset": self.offset, "live": "sse"}
            async with self.session.get(self.url, params=params) as response:
                kind = ""
                async for raw in response.content:
                    line = raw.decode().rstrip("\r\n")
                    if line.startswith("event:"):
                        kind = line[6:].strip()
                    elif line.startswith("data:") and kind == "data":
                        count = len(json.loads(line[5:]))
                        self.events += count
                        self.arrivals.append((time.perf_counter(), count))
                    elif line.startswith("data:") and kind == "control":
                        self.offset = json.loads(line[5:])["streamNextOffset"]
                        self.moved.set()

    async def reach(self, target: str, timeout: float) -> None:
        """Wait until the reader has read up to ``target``."""
        async with asyncio.timeout(timeout):
            while self.offset < target:
                self.moved.clear()
                await self.moved.wait()

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await self.task


async def tail(session: aiohttp.ClientSession, url: str) -> str:
    async with session.head(url) as response:
        return response.headers["Stream-Next-Offset"]


async def bench_writes(args: argparse.Namespace, session: aiohttp.ClientSession) -> None:
    for rows_per_txn in (1, 100):
        shape = "single-row transactions" if rows_per_txn == 1 else "100-row INSERTs"
        plain, published = f"tsb_plain_{stamp()}", f"tsb_pub_{stamp()}"
        await create_table(args.db, plain)
        await create_table(args.db, published)
        rows, samples = await writers(args.db, plain, args.clients, args.seconds, rows_per_txn)
        plain_rate = rows / args.seconds
        print(f"{shape}, {args.clients} clients, plain table:     {plain_rate:8.0f} rows/s   "
              f"commit {latency(samples)}")  # fmt: skip
        path = f"bench/tablesync/{published}"
        manage(args.db, "publish_table", published, "--stream", path)
        url = f"{args.url}/v1/stream/{path}"
        reader = SseCounter(session, url, await tail(session, url))
        await reader.start()
        started = time.perf_counter()
        rows, samples = await writers(args.db, published, args.clients, args.seconds, rows_per_txn)
        written_at = time.perf_counter()
        end = await tail(session, url)
        await reader.reach(end, timeout=60)
        caught_up = time.perf_counter() - written_at
        await reader.stop()
        rate = rows / args.seconds
        print(f"{shape}, {args.clients} clients, published table: {rate:8.0f} rows/s   "
              f"commit {latency(samples)}")  # fmt: skip
        received = reader.events / (reader.arrivals[-1][0] - started) if reader.arrivals else 0
        print(f"  published / plain: {rate / plain_rate:.2f};  SSE reader: {reader.events}"
              f" events ({received:.0f}/s), caught up {caught_up * 1000:.0f} ms after the last"
              " commit")  # fmt: skip
        manage(args.db, "unpublish_table", published)


async def bench_bulk(args: argparse.Namespace) -> None:
    for label, publish in (("plain", False), ("published", True)):
        table = f"tsb_bulk_{stamp()}"
        async with await psycopg.AsyncConnection.connect(args.db, autocommit=True) as conn:
            await conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, label text, n int)")
        if publish:
            manage(args.db, "publish_table", table, "--stream", f"bench/tablesync/{table}")
        async with await psycopg.AsyncConnection.connect(args.db) as conn:
            started = time.perf_counter()
            async with conn.cursor().copy(f"COPY {table} (id, label, n) FROM STDIN") as copy:
                for i in range(args.bulk_rows):
                    await copy.write_row((i, f"bulk row {i}", i % 1000))
            copied = time.perf_counter()
            commit, waits = await _commit_with_probe(args.db, table, conn)
            print(f"COPY {args.bulk_rows} rows, {label:10}: statement {copied - started:5.2f} s,"
                  f" COMMIT {commit:5.0f} ms; a single-row writer of the table waited up to"
                  f" {max(waits):5.0f} ms meanwhile")  # fmt: skip
            started = time.perf_counter()
            await conn.execute(f"UPDATE {table} SET n = n + 1, label = label || '+'")
            updated = time.perf_counter()
            commit, waits = await _commit_with_probe(args.db, table, conn)
            print(f"UPDATE {args.bulk_rows} rows, {label:8}: statement {updated - started:5.2f} s,"
                  f" COMMIT {commit:5.0f} ms; a single-row writer of the table waited up to"
                  f" {max(waits):5.0f} ms meanwhile")  # fmt: skip
        if publish:
            manage(args.db, "unpublish_table", table)


async def _commit_with_probe(
    db: str, table: str, conn: psycopg.AsyncConnection[Any]
) -> tuple[float, list[float]]:
    """COMMIT ``conn`` while another connection inserts single rows into the same table in a
    loop; returns how long the COMMIT took and the probe's latencies (ms) meanwhile."""
    done = asyncio.Event()
    waits: list[float] = [0.0]

    async def probe() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as other:
            while not done.is_set():
                started = time.perf_counter()
                await other.execute(
                    f"INSERT INTO {table} (id, label, n)"
                    f" SELECT coalesce(min(id), 0) - 1, 'probe', 0 FROM {table} WHERE id < 0"
                )
                waits.append((time.perf_counter() - started) * 1000)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.2)
    started = time.perf_counter()
    waits.clear()
    await conn.commit()
    commit = (time.perf_counter() - started) * 1000
    done.set()
    await task
    return commit, waits or [0.0]


async def bench_sink(args: argparse.Namespace, session: aiohttp.ClientSession) -> None:
    path = f"bench/tablesync/sink_{stamp()}"
    table = f"tsb_sink_{stamp()}"
    url = f"{args.url}/v1/stream/{path}"
    async with session.put(url, headers=JSON) as response:
        assert response.status == 201, response.status
    for start in range(0, args.sink_messages, 1000):
        batch = [
            {"order": {"id": i, "total": i * 1.5}, "customer": f"c{i % 97}", "note": "sunk row"}
            for i in range(start, min(start + 1000, args.sink_messages))
        ]
        async with session.post(url, headers=JSON, data=json.dumps(batch)) as response:
            assert response.status in (200, 204), await response.text()
    started = time.perf_counter()
    manage(
        args.db, "sink_stream", path, "--table", table, "--create",
        "--map", "order_id=order.id::bigint", "--map", "total=order.total::numeric",
        "--map", "customer::text", "--map", "note::text",
    )  # fmt: skip
    await _wait_sunk(args.db, path)
    elapsed = time.perf_counter() - started
    print(f"sink: {args.sink_messages} messages applied in {elapsed:.2f} s:"
          f" {args.sink_messages / elapsed:.0f} messages/s (bind included)")  # fmt: skip

    # Producers appending while the sink follows.
    appends = 0

    async def producer(index: int) -> None:
        nonlocal appends
        deadline = time.perf_counter() + args.seconds
        seq = 0
        while time.perf_counter() < deadline:
            body = json.dumps([{"order": {"id": index * 10**6 + seq, "total": 1}, "customer": "p"}])
            headers = producer_headers("application/json", f"p{index}", seq)
            async with session.post(url, headers=headers, data=body) as response:
                assert response.status in (200, 204)
            seq += 1
            appends += 1

    started = time.perf_counter()
    await asyncio.gather(*(producer(i) for i in range(args.clients)))
    stopped = time.perf_counter()
    behind = await _behind(args.db, path)
    await _wait_sunk(args.db, path)
    print(f"sink while {args.clients} producers append: {appends / (stopped - started):.0f}"
          f" appends/s; the sink was {behind} messages behind when they stopped, caught up"
          f" {(time.perf_counter() - stopped) * 1000:.0f} ms later")  # fmt: skip


async def _behind(db: str, path: str) -> int:
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT s.next_seq - k.applied_seq FROM ds_stream_sink AS k"
            " JOIN ds_stream AS s ON s.id = k.stream_id WHERE k.stream_path = %s",
            (path,),
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def _wait_sunk(db: str, path: str) -> None:
    deadline = time.perf_counter() + 600
    while await _behind(db, path) > 0:
        if time.perf_counter() > deadline:
            raise RuntimeError("the sink did not catch up in 10 minutes")
        await asyncio.sleep(0.01)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url", help="base URL of a running server")
    parser.add_argument("--database-url", dest="db", default=os.environ.get("DATABASE_URL"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--bulk-rows", type=int, default=100_000)
    parser.add_argument("--sink-messages", type=int, default=100_000)
    parser.add_argument("--only", default="writes,bulk,sink")
    args = parser.parse_args()
    if not args.db:
        parser.error("the server's database: --database-url or DATABASE_URL")
    only = set(args.only.split(","))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if "writes" in only:
            await bench_writes(args, session)
        if "bulk" in only:
            await bench_bulk(args)
        if "sink" in only:
            await bench_sink(args, session)


if __name__ == "__main__":
    asyncio.run(main())
