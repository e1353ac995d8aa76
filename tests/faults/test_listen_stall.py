"""A stalled LISTEN connection: live readers must still get new data.

Server A writes, connected to PostgreSQL directly. Server B reaches PostgreSQL through a TCP
proxy (``DS_DB__LISTEN_URL``, and its pool too, so that a server without that setting also
listens through it), with a LISTEN heartbeat of 0.5 s and a long-poll timeout of 20 s. A
long-poll and an SSE reader wait on B at the tail of a stream. The proxy then freezes B's
LISTEN connections (it stops forwarding both ways without closing them: a half-open
connection, no error, no FIN) while still forwarding new connections, and A appends.

B never hears that NOTIFY. It must notice the silence (its heartbeat gets no answer), replace
the connection and wake its readers, which re-read: the long-poll answers 200 with the new
message (not a 204 "up to date" at the stale offset once its 20 s pass) and the SSE reader
receives it, before its 15 s keep-alive. Before the heartbeat (53fc172) the long-poll waited
out its timeout and answered 204, and the SSE reader only got the message at its keep-alive.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.faults.conftest import Report, StartServer
from tests.faults.processes import PgCluster, wait_for
from tests.faults.proxy import StallingProxy
from tests.faults.traffic import SseReader, Traffic

pytestmark = pytest.mark.faults

LONG_POLL_TIMEOUT = 20.0
HEARTBEAT = 0.5
# The SSE reader must have the message within this of the append. B notices the stall after
# twice the heartbeat, plus up to 5 s in which psycopg waits for the unanswered heartbeat it
# cancels; an SSE connection also re-reads at its 15 s keep-alive at the latest (53fc172 did),
# which this bound excludes.
SSE_DELIVERY_BOUND = 10.0


def test_live_readers_get_new_data_when_the_listen_connection_stalls(
    cluster: PgCluster, servers: StartServer, report: Report
) -> None:
    proxy = StallingProxy("127.0.0.1", cluster.port).start()
    try:
        writer = servers("stall-writer", workers=1)
        through_proxy = proxy.url(cluster.url)
        reader = servers(
            "stall-reader",
            workers=1,
            database_url=through_proxy,
            env={
                "DS_DB__LISTEN_URL": through_proxy,
                "DS_DB__LISTEN_HEARTBEAT_SECS": str(HEARTBEAT),
                "DS_SERVER__LONG_POLL_TIMEOUT_SECS": str(LONG_POLL_TIMEOUT),
            },
        )
        path = f"faults/stall-{time.time_ns()}"
        created = httpx.put(
            writer.stream_url(path), headers={"Content-Type": "application/json"}, timeout=30
        )
        assert created.status_code == 201
        tail = created.headers["Stream-Next-Offset"]

        # A long-poll at the tail, waiting on B.
        long_poll: dict[str, Any] = {}

        def wait_long_poll() -> None:
            started = time.monotonic()
            try:
                response = httpx.get(
                    reader.stream_url(path),
                    params={"offset": tail, "live": "long-poll"},
                    timeout=LONG_POLL_TIMEOUT + 20,
                )
            except httpx.HTTPError as exc:
                long_poll["error"] = repr(exc)
            else:
                long_poll["response"] = response
            long_poll["ended"] = time.monotonic()
            long_poll["seconds"] = long_poll["ended"] - started

        poller = threading.Thread(target=wait_long_poll, daemon=True)
        poller.start()
        # And an SSE reader from the tail, also on B; once its first control event arrived,
        # B is listening and both readers wait.
        sse = SseReader("stall-sse", reader.base_url, path, offset=tail)
        traffic = Traffic([], lambda: [writer.base_url], [sse]).start()
        try:
            wait_for(lambda: sse.controls >= 1, 30, "the SSE reader's first control event")
            wait_for(lambda: proxy.open_links(b"LISTEN") >= 1, 30, "B to listen via the proxy")
            time.sleep(0.5)  # the long-poll's request reaches B (nothing to poll from here)
            assert "ended" not in long_poll, long_poll

            frozen = proxy.freeze(b"LISTEN")
            assert frozen >= 1
            appended = httpx.post(
                writer.stream_url(path),
                content=json.dumps({"after": "freeze"}),
                headers={"Content-Type": "application/json"},
                timeout=30,
            )
            assert appended.status_code == 204, appended.text
            appended_at = time.monotonic()

            sse_seconds: float | None = None
            if wait_until(lambda: bool(sse.messages), SSE_DELIVERY_BOUND):
                sse_seconds = time.monotonic() - appended_at
            poller.join(LONG_POLL_TIMEOUT + 30)
        finally:
            traffic.stop()

        response: httpx.Response | None = long_poll.get("response")
        report(
            frozen_listen_connections=frozen,
            long_poll_status=response.status_code if response is not None else long_poll,
            long_poll_seconds_after_append=long_poll["ended"] - appended_at,
            long_poll_offset_moved=response is not None
            and response.headers.get("Stream-Next-Offset") != tail,
            sse_seconds_after_append=sse_seconds,
            sse_messages=sse.messages,
            new_listen_connections=proxy.open_links(b"LISTEN"),
        )
        assert response is not None, long_poll
        assert response.status_code == 200, (response.status_code, response.headers)
        assert response.json() == [{"after": "freeze"}]
        assert response.headers["Stream-Next-Offset"] > tail
        assert sse_seconds is not None, "the SSE reader did not get the message in time"
        assert sse.messages == [{"after": "freeze"}]
    finally:
        proxy.stop()


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` for up to ``timeout`` seconds; whether it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())
