"""Compacting a state stream: 1,000,000 events over 10,000 keys, and what appends to another
stream see while it runs.

Usage: python bench/compaction_bench.py BASE_URL [--events 1000000] [--keys 10000]
           [--producers 4] [--reuse-events 500000] [--autovacuum-wait 240]

Against the server at BASE_URL and its database (DATABASE_URL as the server has it, or both
unset for the project's local cluster; the database is read directly for sizes):

1. appends the events (inserts, updates and deletes over ``--keys`` keys of 4 types, 8 % of
   them deletes, a reset at a quarter) to a new JSON stream registered as a state stream, in
   appends of 1,000 events by 16 producers;
2. starts ``--producers`` writers appending small messages (100 bytes) to another stream, one
   append after another each, measuring every append's latency;
3. runs ``manage.py compact_state --stream PATH`` and times it, while the writers go on;
4. prints: compaction time; the stream's rows and bytes before and after; the append latency
   (p50, p99, max) on the other stream before, during and after the compaction; the sizes of
   ds_message (heap, TOAST, indexes) before, right after, after autovacuum (waited for up to
   ``--autovacuum-wait`` seconds, then a manual VACUUM if it has not come), and after appending
   ``--reuse-events`` more events to a third stream (does the table grow, or reuse the space?).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from common import latency, percentile

ROOT = Path(__file__).resolve().parent.parent
BATCH = 1000
TYPES = ["user", "order", "item", "flag"]
JSON_HEADERS = {"Content-Type": "application/json"}


def database_conninfo() -> str:
    """The database the server uses, as Django's settings name it."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "durable_project.settings")
    import django

    django.setup()
    from streams.store.pool import conninfo

    return conninfo()


def events_batch(index: int, size: int, keys: int, reset_at: int) -> bytes:
    rng = random.Random(index)
    events: list[dict[str, Any]] = []
    for i in range(size):
        if index * BATCH + i == reset_at:
            events.append({"headers": {"control": "reset"}})
            continue
        entity_type = rng.choice(TYPES)
        key = f"{entity_type}-{rng.randrange(keys // len(TYPES))}"
        if rng.random() < 0.08:
            events.append({"type": entity_type, "key": key, "headers": {"operation": "delete"}})
        else:
            value = {"n": index * BATCH + i, "label": f"{entity_type} {key}", "score": rng.random()}
            operation = "update" if rng.random() < 0.7 else "insert"
            events.append(
                {
                    "type": entity_type,
                    "key": key,
                    "value": value,
                    "headers": {"operation": operation},
                }
            )
    return json.dumps(events).encode()


async def generate(
    session: aiohttp.ClientSession, url: str, events: int, keys: int, producers: int = 16
) -> float:
    sizes = [min(BATCH, events - start) for start in range(0, events, BATCH)]
    reset_at = events // 4

    async def producer(index: int) -> None:
        for n in range(index, len(sizes), producers):
            body = events_batch(n, sizes[n], keys, reset_at)
            async with session.post(url, data=body, headers=JSON_HEADERS) as response:
                assert response.status == 204, await response.text()

    started = time.perf_counter()
    # In order: producer p sends batches p, p + 16, ...; the stream's order is arrival order.
    await asyncio.gather(*(producer(i) for i in range(producers)))
    return time.perf_counter() - started


class Writers:
    """Writers appending 100-byte messages to one stream, each append after the previous one
    is acknowledged; every latency is recorded with the moment it ended."""

    def __init__(self, session: aiohttp.ClientSession, url: str, count: int) -> None:
        self.session = session
        self.url = url
        self.count = count
        self.samples: list[tuple[float, float]] = []  # (ended at, latency in ms)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _writer(self, index: int) -> None:
        body = (f"writer {index} " + "x" * 100)[:100].encode()
        headers = {"Content-Type": "text/plain"}
        while not self._stop.is_set():
            started = time.perf_counter()
            async with self.session.post(self.url, data=body, headers=headers) as response:
                assert response.status == 204, await response.text()
            ended = time.perf_counter()
            self.samples.append((ended, (ended - started) * 1000))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._writer(i)) for i in range(self.count)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def between(self, start: float, end: float) -> list[float]:
        return [ms for at, ms in self.samples if start <= at < end]


def report(label: str, samples: list[float], seconds: float) -> None:
    rate = len(samples) / seconds if seconds else 0
    print(f"  {label:<28} {len(samples):6d} appends ({rate:5.0f}/s)   {latency(samples)}"
          f"   max {max(samples, default=0):7.2f} ms")  # fmt: skip


def stream_size(conn: psycopg.Connection[Any], path: str) -> tuple[int, int]:
    row = conn.execute(
        "SELECT count(*), coalesce(sum(octet_length(m.data)), 0) FROM ds_message AS m"
        " JOIN ds_stream AS s ON s.id = m.stream_id WHERE s.path = %s",
        [path],
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def table_sizes(conn: psycopg.Connection[Any]) -> dict[str, int]:
    row = conn.execute(
        "SELECT pg_relation_size('ds_message'),"
        " pg_relation_size(reltoastrelid), pg_indexes_size('ds_message'),"
        " pg_total_relation_size('ds_message')"
        " FROM pg_class WHERE oid = 'ds_message'::regclass"
    ).fetchone()
    assert row is not None
    return dict(zip(("heap", "toast", "indexes", "total"), row, strict=True))


# A heap tuple's line pointer: pg_column_size of a whole row already counts its 24-byte header.
TUPLE_OVERHEAD = 4


def live_bytes(conn: psycopg.Connection[Any]) -> int:
    """About how much of the heap live rows fill (a scan of the whole table)."""
    row = conn.execute(
        "SELECT count(*), coalesce(sum(pg_column_size(m.*)), 0) FROM ds_message AS m"
    ).fetchone()
    assert row is not None
    return row[1] + row[0] * TUPLE_OVERHEAD


def table_state(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """The table's sizes, what its live rows fill, and its dead tuples, now."""
    return table_sizes(conn) | {"live": live_bytes(conn), "dead": dead_tuples(conn)[0]}


def show_sizes(label: str, state: dict[str, int]) -> None:
    mib = {name: value / 2**20 for name, value in state.items()}
    print(f"  {label:<34} heap {mib['heap']:6.1f} MiB (live rows {mib['live']:6.1f} MiB,"
          f" {state['dead']:7d} dead)  TOAST {mib['toast']:5.1f}  indexes {mib['indexes']:5.1f}"
          f"  total {mib['total']:6.1f} MiB")  # fmt: skip


def dead_tuples(conn: psycopg.Connection[Any]) -> tuple[int, Any]:
    row = conn.execute(
        "SELECT n_dead_tup, last_autovacuum FROM pg_stat_user_tables WHERE relname = 'ds_message'"
    ).fetchone()
    assert row is not None
    return row[0], row[1]


async def compact_command(path: str) -> str:
    """Run ``manage.py compact_state --stream PATH``; its output."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "manage.py", "compact_state", "--stream", path,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await process.communicate()
    assert process.returncode == 0, output.decode()
    return output.decode()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--reuse-events", type=int, default=500_000)
    parser.add_argument("--autovacuum-wait", type=float, default=240.0)
    parser.add_argument("--baseline-secs", type=float, default=15.0)
    args = parser.parse_args()
    base = args.base_url.rstrip("/")
    tag = uuid.uuid4().hex[:8]
    path, other, reuse = f"bench-compaction-{tag}", f"bench-writers-{tag}", f"bench-reuse-{tag}"
    conn = psycopg.connect(database_conninfo(), autocommit=True)

    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for stream in (path, other, reuse):
            headers = JSON_HEADERS if stream != other else {"Content-Type": "text/plain"}
            async with session.put(f"{base}/v1/stream/{stream}", headers=headers) as response:
                assert response.status == 201, response.status
        # Registered without compaction: the benchmark compacts it itself, once.
        async with session.post(f"{base}/v1/state/streams", json={"stream": path}) as response:
            assert response.status == 201, await response.text()

        generated = await generate(session, f"{base}/v1/stream/{path}", args.events, args.keys)
        print(f"generated {args.events} events over {args.keys} keys in {generated:.1f}s"
              f" ({args.events / generated:.0f} events/s)")  # fmt: skip
        async with session.get(f"{base}/v1/state/streams/{path}") as response:
            registration = await response.json()  # caught up: every event materialized
        async with session.get(
            f"{base}/v1/state/entities", params={"stream": path, "page_size": 1}
        ) as response:
            entity_count = (await response.json())["count"]
        print(f"materialized to {registration['materialized_offset']}: {entity_count} entities")
        rows_before, bytes_before = stream_size(conn, path)
        sizes_before = table_state(conn)
        # Autovacuum may come while the compaction still runs: any after this one counts.
        _, vacuumed_before = dead_tuples(conn)

        writers = Writers(session, f"{base}/v1/stream/{other}", args.producers)
        writers.start()
        baseline_start = time.perf_counter()
        await asyncio.sleep(args.baseline_secs)
        compaction_start = time.perf_counter()
        output = await compact_command(path)
        compaction_end = time.perf_counter()
        await asyncio.sleep(args.baseline_secs)
        after_end = time.perf_counter()
        await writers.stop()

        rows_after, bytes_after = stream_size(conn, path)
        sizes_after = table_state(conn)
        async with session.get(
            f"{base}/v1/state/entities", params={"stream": path, "page_size": 1}
        ) as response:
            assert (await response.json())["count"] == entity_count

        print(f"\nmanage.py compact_state: {compaction_end - compaction_start:.1f}s in all"
              " (the command's start-up included)")  # fmt: skip
        for line in output.splitlines():
            if line.startswith(path):
                print(f"  {line}")
        print(f"  rows  {rows_before:>10,} -> {rows_after:>10,}"
              f"  ({rows_after / rows_before:.1%} kept)")  # fmt: skip
        print(f"  bytes {bytes_before:>10,} -> {bytes_after:>10,}"
              f"  ({bytes_after / bytes_before:.1%} kept)")  # fmt: skip
        print(f"\nappends to another stream, {args.producers} writers, 100 bytes each:")
        report("before compaction", writers.between(baseline_start, compaction_start),
               compaction_start - baseline_start)  # fmt: skip
        report("during compaction", writers.between(compaction_start, compaction_end),
               compaction_end - compaction_start)  # fmt: skip
        report("after compaction", writers.between(compaction_end, after_end),
               after_end - compaction_end)  # fmt: skip

        print("\nds_message (the whole table, every stream):")
        show_sizes("before compaction", sizes_before)
        show_sizes("right after compaction", sizes_after)
        waited_from = time.perf_counter()
        while time.perf_counter() - waited_from < args.autovacuum_wait:
            _, last = dead_tuples(conn)
            if last is not None and last != vacuumed_before:
                vacuumed_by = f"autovacuum (seen {time.perf_counter() - waited_from:.0f}s after)"
                break
            await asyncio.sleep(2)
        else:
            started = time.perf_counter()
            conn.execute("VACUUM ds_message")
            vacuumed_by = f"manual VACUUM ({time.perf_counter() - started:.1f}s)"
        show_sizes(f"after {vacuumed_by}", table_state(conn))

        if args.reuse_events:
            await generate(session, f"{base}/v1/stream/{reuse}", args.reuse_events, args.keys)
            reuse_rows, reuse_bytes = stream_size(conn, reuse)
            show_sizes(f"after {reuse_rows:,} new events ({reuse_bytes / 2**20:.0f} MiB)",
                       table_state(conn))  # fmt: skip
        p99_before = percentile(writers.between(baseline_start, compaction_start), 0.99)
        p99_during = percentile(writers.between(compaction_start, compaction_end), 0.99)
        print(f"\np99 during / before compaction: {p99_during / p99_before:.2f}x")
    conn.close()


if __name__ == "__main__":
    asyncio.run(main())
