"""Concurrent writes, deletes, trims and reads on fork trees (PROTOCOL.md 4.2, 5.1, 5.4).

Many keep-alive clients race every operation of the protocol on a few fork trees (a stream, its
fork and the fork's fork) for a bounded time: creates, forks, deletes (soft deletes of sources
with forks, cascading removals when the last fork goes), appends, trims and reads, on streams
without a TTL, with a long sliding TTL (every read renews it) and with a TTL short enough that
streams expire during the run (expired on access, and by the expiry sweep). A fork's removal
takes its source's row as well as its own; before the fork chains were locked in one order,
such races deadlocked in PostgreSQL and answered 500. No request may fail with a 5xx (a 503
with Retry-After, the pool shedding load when the machine is busy, is retried as a client
would: a few times), and afterwards the store must be consistent: every fork_refcount counts
the forks that exist, no soft-deleted stream outlives its last fork, and no message, producer,
mark or purge entry outlives its stream.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import aiohttp
import psycopg

TREES = (None, 3600, 1)  # each tree's Stream-TTL: none, long (renewed by reads), expiring
CLIENTS_PER_TREE = 40
SECONDS = 6.0
MAX_REQUESTS = 10000  # all clients together: the run is bounded by count as well as by time
RETRIES = 4  # attempts at a request answered 503 with Retry-After


def _tree(prefix: str, index: int) -> tuple[str, str, str]:
    """A source, its fork and the fork's fork."""
    root = f"{prefix}/t{index}"
    return root, f"{root}/f", f"{root}/f/g"


def _request(
    tree: tuple[str, str, str], ttl: int | None, rng: random.Random
) -> tuple[str, str, dict[str, str], bytes]:
    """One operation of the racing mix: (method, path, headers, body)."""
    root, fork, grandchild = tree
    ttl_header = {"Stream-TTL": str(ttl)} if ttl is not None else {}
    op = rng.choice(("create", "fork", "delete", "append", "trim", "get"))
    # The fork's fork is the rarer one: most races are between a source and its fork.
    path = rng.choice((root, fork) * 4 + (grandchild,))
    if op == "create":
        return "PUT", path, {"Content-Type": "text/plain", **ttl_header}, b""
    if op == "fork":
        path, source = rng.choice(((fork, root),) * 4 + ((grandchild, fork),))
        return "PUT", path, {"Stream-Forked-From": source, **ttl_header}, b""
    if op == "delete":
        return "DELETE", path, {}, b""
    if op == "append":
        return "POST", path, {"Content-Type": "text/plain"}, b"hello"
    if op == "trim":
        return "POST", path, {"Stream-Trim-Before": "now"}, b""
    return "GET", f"{path}?offset=-1", {}, b""


async def _client(
    base_url: str,
    tree: tuple[str, str, str],
    ttl: int | None,
    seed: int,
    deadline: float,
    budget: list[int],
    answers: Counter[tuple[str, int]],
    failures: list[tuple[str, str, int, str]],
) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(
        base_url, connector=aiohttp.TCPConnector(limit=1), timeout=aiohttp.ClientTimeout(30)
    ) as session:
        while time.monotonic() < deadline and budget[0] > 0:
            method, path, headers, body = _request(tree, ttl, rng)
            for attempt in range(1, RETRIES + 1):
                budget[0] -= 1
                async with session.request(
                    method, f"/v1/stream/{path}", headers=headers, data=body
                ) as response:
                    text = await response.text()
                answers[(method, response.status)] += 1
                # Asked to retry later (a loaded machine's pool shedding load): as a client would.
                if response.status != 503 or "Retry-After" not in response.headers:
                    break
                if attempt < RETRIES:
                    await asyncio.sleep(0.2)
            if response.status >= 500:
                failures.append((method, path, response.status, text[:200]))


def _inconsistencies(database_url: str, prefix: str, first_id: int) -> dict[str, list[Any]]:
    """What the store holds that it must not, among the streams of this test (and rows of
    streams created since ``first_id``, whose stream may be gone)."""
    with psycopg.connect(database_url, autocommit=True) as conn:

        def rows(sql: str) -> list[Any]:
            return conn.execute(sql, {"prefix": prefix, "first": first_id}).fetchall()

        return {
            "refcount differs from the forks that exist": rows(
                "SELECT s.path, s.fork_refcount, (SELECT count(*) FROM ds_stream AS f"
                " WHERE f.fork_source_id = s.id) FROM ds_stream AS s"
                " WHERE starts_with(s.path, %(prefix)s) AND s.fork_refcount <> (SELECT count(*)"
                " FROM ds_stream AS f WHERE f.fork_source_id = s.id)"
            ),
            "soft-deleted stream without forks": rows(
                "SELECT path FROM ds_stream WHERE starts_with(path, %(prefix)s)"
                " AND deleted_at IS NOT NULL AND fork_refcount = 0"
            ),
            **{
                f"orphaned {table} rows": rows(
                    f"SELECT DISTINCT stream_id FROM {table} AS x WHERE stream_id >= %(first)s"
                    " AND NOT EXISTS (SELECT 1 FROM ds_stream AS s WHERE s.id = x.stream_id)"
                )
                for table in ("ds_message", "ds_producer", "ds_stream_mark", "ds_purge_pending")
            },
        }


def test_racing_operations_on_fork_trees_never_fail_and_leave_a_consistent_store(
    start_server: Any, database_url: str
) -> None:
    # Two worker processes, as in production; the expiry sweep runs often, so expired forks
    # are reclaimed by it as well as on access.
    server = start_server(env={"DS_SERVER__EXPIRY_SWEEP_INTERVAL_SECS": "0.5"}, workers=2)
    prefix = f"tests/fork-races-{time.time_ns()}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM ds_stream").fetchone()
    assert row is not None
    first_id = row[0]

    answers: Counter[tuple[str, int]] = Counter()
    failures: list[tuple[str, str, int, str]] = []
    budget = [MAX_REQUESTS]

    async def race() -> None:
        deadline = time.monotonic() + SECONDS
        await asyncio.gather(
            *(
                _client(server.base_url, tree, ttl, seed, deadline, budget, answers, failures)
                for index, ttl in enumerate(TREES)
                for tree in [_tree(prefix, index)]
                for seed in range(index * 100, index * 100 + CLIENTS_PER_TREE)
            )
        )

    asyncio.run(race())

    assert not failures, (len(failures), failures[:5], sorted(answers.items()))
    # The mix did race: forks were made and deleted, sources soft-deleted.
    assert answers[("PUT", 201)] and answers[("DELETE", 204)], sorted(answers.items())
    assert not {
        what: found for what, found in _inconsistencies(database_url, prefix, first_id).items()
        if found
    }  # fmt: skip
