"""SIGTERM with live readers open: the server ends them and exits promptly.

A server (the production command: two workers, ``--timeout-graceful-shutdown 10``, a long-poll
timeout of 60 s) has long-polls and SSE readers waiting on a stream, with the SSE reconnect
interval at its default (60 s) and at 0 (connections never end by themselves). SIGTERM to the
server (its master, as an orchestrator sends it) must end every live reader at once: the
long-polls answer 204, the SSE responses end cleanly (a complete chunked body, no error), and
every process of the server exits within EXIT_BOUND seconds, well before the graceful-shutdown
timeout would cut the connections. Before the lifespan that ends readers (53fc172) uvicorn
waited the full 10 s and then dropped them mid-response.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import httpx
import pytest

from tests.faults.conftest import Report, StartServer
from tests.faults.processes import PgCluster, alive, wait_for

pytestmark = pytest.mark.faults

LONG_POLLS = 4
SSE_READERS = 4
EXIT_BOUND = 5.0


async def _long_poll(client: httpx.AsyncClient, url: str, offset: str) -> dict[str, Any]:
    try:
        response = await client.get(url, params={"offset": offset, "live": "long-poll"})
    except httpx.HTTPError as exc:
        return {"error": repr(exc), "ended": time.monotonic()}
    return {"status": response.status_code, "ended": time.monotonic()}


async def _sse(
    client: httpx.AsyncClient, url: str, offset: str, controls: list[int], index: int
) -> dict[str, Any]:
    """Read an SSE response to its end; ``clean`` when the body ended completely."""
    try:
        params = {"offset": offset, "live": "sse"}
        async with client.stream("GET", url, params=params) as response:
            async for line in response.aiter_lines():
                if line.startswith("event: control") or line.startswith("event:control"):
                    controls[index] += 1
    except httpx.HTTPError as exc:
        return {"clean": False, "error": repr(exc), "ended": time.monotonic()}
    return {"clean": True, "status": response.status_code, "ended": time.monotonic()}


@pytest.mark.parametrize("sse_reconnect_interval", ["60", "0"])
def test_sigterm_ends_live_readers_and_the_server_exits(
    cluster: PgCluster, servers: StartServer, report: Report, sse_reconnect_interval: str
) -> None:
    server = servers(
        f"sigterm-{sse_reconnect_interval}",
        env={
            "DS_SERVER__LONG_POLL_TIMEOUT_SECS": "60",
            "DS_SERVER__SSE_RECONNECT_INTERVAL_SECS": sse_reconnect_interval,
        },
    )
    url = server.stream_url(f"faults/sigterm-{time.time_ns()}")
    created = httpx.put(url, headers={"Content-Type": "text/plain"}, content=b"x", timeout=30)
    assert created.status_code == 201
    tail = created.headers["Stream-Next-Offset"]
    controls = [0] * SSE_READERS

    async def readers() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=LONG_POLLS + SSE_READERS)
        async with httpx.AsyncClient(timeout=90, limits=limits) as client:
            return await asyncio.gather(
                *(_long_poll(client, url, tail) for _ in range(LONG_POLLS)),
                *(_sse(client, url, tail, controls, i) for i in range(SSE_READERS)),
            )

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        results = pool.submit(asyncio.run, readers())
        # Every SSE reader has had its first control event: the server follows them all.
        wait_for(lambda: all(controls), 30, "the SSE readers to start")
        time.sleep(0.5)  # the long-polls' requests reach the server (nothing to poll here)
        assert not results.done()
        workers = server.worker_pids()
        signalled = time.monotonic()
        server.terminate()
        assert server.process is not None
        exit_code = server.process.wait(timeout=60)
        exit_seconds = time.monotonic() - signalled
        wait_for(lambda: not any(alive(pid) for pid in workers), 30, "the workers to exit")
        outcomes = results.result(timeout=60)

    long_polls, sse = outcomes[:LONG_POLLS], outcomes[LONG_POLLS:]
    report(
        sse_reconnect_interval=sse_reconnect_interval,
        exit_seconds=exit_seconds,
        exit_code=exit_code,
        long_poll_statuses=[o.get("status", o.get("error")) for o in long_polls],
        long_poll_seconds=max(o["ended"] - signalled for o in long_polls),
        sse_clean_ends=sum(1 for o in sse if o["clean"]),
        sse_errors=[o["error"] for o in sse if not o["clean"]],
        sse_seconds=max(o["ended"] - signalled for o in sse),
    )
    assert exit_seconds < EXIT_BOUND
    assert exit_code == 0
    assert [o.get("status") for o in long_polls] == [204] * LONG_POLLS, long_polls
    assert all(o["clean"] and o["status"] == 200 for o in sse), sse
