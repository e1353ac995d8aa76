"""Live delivery across server processes (DESIGN.md, Live delivery; PROTOCOL.md 5.7, 5.8).

Two server processes share one database. Readers connected to process 1 must be woken by an
append made through process 2: the append's NOTIFY reaches process 1's LISTEN connection.
The 100 ms bound separates notification-driven delivery from any polling or timeout path (the
test servers' long-poll timeout is 2 s); it is the issue's stated requirement. Delivery is timed
from process 2's acknowledgement (the append is made once committed), and the bound applies to
the median of several rounds: a single round stalled by an unrelated scheduling hiccup on a busy
two-core machine is noise, not a protocol failure. Every round must still arrive well inside the
long-poll timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import free_port

DELIVERY_BOUND_SECONDS = 0.100
JSON = {"Content-Type": "application/json"}
ROUNDS = 7
ANY_ROUND_BOUND_SECONDS = 1.0


@pytest.fixture(scope="module")
def two_servers(server: Any, start_server: Any) -> tuple[Any, Any]:
    return server, start_server()


async def _sse(
    client: httpx.AsyncClient, url: str, offset: str
) -> AsyncIterator[tuple[str, str, float]]:
    """(event type, data, arrival time) of each event of an SSE read, until the server ends
    the response."""
    async with client.stream("GET", url, params={"offset": offset, "live": "sse"}) as response:
        assert response.status_code == 200
        event, data = None, []
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:])
            elif line == "" and event is not None:
                yield event, "\n".join(data), time.perf_counter()
                event, data = None, []


async def _sse_events(
    client: httpx.AsyncClient, url: str, offset: str, queue: asyncio.Queue
) -> None:
    async for event in _sse(client, url, offset):
        queue.put_nowait(event)


async def _timed(request: Awaitable[httpx.Response]) -> tuple[httpx.Response, float]:
    """The response and the moment it arrived."""
    response = await request
    return response, time.perf_counter()


def test_readers_on_one_process_see_appends_through_another(two_servers: tuple[Any, Any]) -> None:
    """PROTOCOL.md 5.7 and 5.8: a long-poll and an SSE reader on process 1 receive an append
    made through process 2 within 100 ms (the median of seven rounds)."""
    first, second = two_servers

    async def scenario() -> None:
        url_1 = first.stream_url(f"multiprocess/{time.time_ns()}")
        url_2 = url_1.replace(first.base_url, second.base_url)
        async with httpx.AsyncClient(timeout=10) as client:
            created = await client.put(url_1, headers={"Content-Type": "text/plain"})
            assert created.status_code == 201
            offset = created.headers["Stream-Next-Offset"]
            events: asyncio.Queue = asyncio.Queue()
            sse_task = asyncio.create_task(_sse_events(client, url_1, offset, events))
            # The SSE reader is subscribed once its first control event arrives.
            kind, _, _ = await asyncio.wait_for(events.get(), 5)
            assert kind == "control"

            poll_delays: list[float] = []
            sse_delays: list[float] = []
            for round_number in range(ROUNDS):
                body = f"message {round_number}"
                poll = asyncio.create_task(
                    _timed(client.get(url_1, params={"offset": offset, "live": "long-poll"}))
                )
                await asyncio.sleep(0.2)  # the long-poll is waiting on process 1
                appended = await client.post(
                    url_2, content=body, headers={"Content-Type": "text/plain"}
                )
                acked_at = time.perf_counter()
                assert appended.status_code == 204

                answer, polled_at = await asyncio.wait_for(poll, 5)
                assert answer.status_code == 200
                assert answer.text == body
                offset = answer.headers["Stream-Next-Offset"]
                assert offset == appended.headers["Stream-Next-Offset"]

                kind, data, received_at = await asyncio.wait_for(events.get(), 5)
                assert (kind, data) == ("data", body)
                kind, control, _ = await asyncio.wait_for(events.get(), 5)
                assert kind == "control" and offset in control

                poll_delays.append(max(0.0, polled_at - acked_at))
                sse_delays.append(max(0.0, received_at - acked_at))
            for delays in (poll_delays, sse_delays):
                assert statistics.median(delays) < DELIVERY_BOUND_SECONDS, delays
                assert max(delays) < ANY_ROUND_BOUND_SECONDS, delays
            sse_task.cancel()

    asyncio.run(scenario())


def test_close_and_delete_wake_readers_on_other_process(two_servers: tuple[Any, Any]) -> None:
    """PROTOCOL.md 5.7 / 5.4: closing through process 2 ends a long-poll on process 1 with
    Stream-Closed; deleting ends an SSE connection on process 1."""
    first, second = two_servers

    async def scenario() -> None:
        path = f"multiprocess/close-{time.time_ns()}"
        async with httpx.AsyncClient(timeout=10) as client:
            created = await client.put(
                first.stream_url(path), headers={"Content-Type": "text/plain"}
            )
            offset = created.headers["Stream-Next-Offset"]
            poll = asyncio.create_task(
                client.get(first.stream_url(path), params={"offset": offset, "live": "long-poll"})
            )
            await asyncio.sleep(0.2)
            closed = await client.post(second.stream_url(path), headers={"Stream-Closed": "true"})
            assert closed.status_code == 204
            answer = await poll
            # Woken by the close: a long-poll that waited out its timeout (2 s) answers 204
            # too, but with the stream as its first read found it, without Stream-Closed.
            assert answer.status_code == 204
            assert answer.headers["Stream-Closed"] == "true"

            other = f"multiprocess/delete-{time.time_ns()}"
            await client.put(first.stream_url(other), headers={"Content-Type": "text/plain"})
            events: asyncio.Queue = asyncio.Queue()
            reader = asyncio.create_task(_sse_events(client, first.stream_url(other), "-1", events))
            await asyncio.wait_for(events.get(), 5)
            deleted = await client.delete(second.stream_url(other))
            assert deleted.status_code == 204
            # The event stream ended (unwoken, it would last the 60 s between reconnections).
            await asyncio.wait_for(reader, 20)

    asyncio.run(scenario())


async def _sse_until_closed(client: httpx.AsyncClient, url: str) -> list[Any]:
    """Every JSON item an SSE reader from the start receives, until the stream closes."""
    return [
        item
        async for kind, data, _ in _sse(client, url, "-1")
        if kind == "data"
        for item in json.loads(data)
    ]


async def _long_polls_until_closed(client: httpx.AsyncClient, url: str) -> list[Any]:
    items: list[Any] = []
    offset = "-1"
    while True:
        answer = await client.get(url, params={"offset": offset, "live": "long-poll"})
        assert answer.status_code in (200, 204), answer.text
        if answer.status_code == 200:
            items.extend(answer.json())
        offset = answer.headers["Stream-Next-Offset"]
        if answer.headers.get("Stream-Closed") == "true":
            return items


def test_interleaved_writers_on_two_processes_reach_live_readers_in_order(
    two_servers: tuple[Any, Any],
) -> None:
    """Live readers on process 1 receive exactly what the stream holds, in its order, while
    both processes append to it at once: small appends (whose data travels with the
    notification), large ones (which readers re-read), and batches. Readers on either process
    see the same items as a catch-up read afterwards."""
    first, second = two_servers

    async def writer(client: httpx.AsyncClient, url: str, name: str) -> None:
        for n in range(40):
            if n % 7 == 3:
                body = json.dumps({"from": name, "n": n, "pad": "x" * 6000})  # over 4 KiB
            elif n % 5 == 0:
                body = json.dumps([{"from": name, "n": n, "part": 0}, {"from": name, "n": n}])
            else:
                body = json.dumps({"from": name, "n": n})
            answer = await client.post(
                url, content=body, headers={"Content-Type": "application/json"}
            )
            assert answer.status_code == 204, answer.text

    async def scenario() -> None:
        path = f"multiprocess/interleaved-{time.time_ns()}"
        url_1, url_2 = first.stream_url(path), second.stream_url(path)
        async with httpx.AsyncClient(timeout=20) as client:
            created = await client.put(url_1, headers={"Content-Type": "application/json"})
            assert created.status_code == 201
            readers = [
                asyncio.create_task(_sse_until_closed(client, url_1)),
                asyncio.create_task(_sse_until_closed(client, url_2)),
                asyncio.create_task(_long_polls_until_closed(client, url_1)),
            ]
            await asyncio.sleep(0.3)  # the readers are waiting
            await asyncio.gather(writer(client, url_1, "one"), writer(client, url_2, "two"))
            closed = await client.post(url_2, headers={"Stream-Closed": "true"})
            assert closed.status_code == 204
            received = await asyncio.wait_for(asyncio.gather(*readers), 20)
            stored = (await client.get(url_1, params={"offset": "-1"})).json()

        pairs = sum(1 for n in range(40) if n % 7 != 3 and n % 5 == 0)
        assert len(stored) == 2 * (40 + pairs)
        for name in ("one", "two"):  # each writer's own appends keep their order
            mine = [item["n"] for item in stored if item["from"] == name and "part" not in item]
            assert mine == list(range(40))
        for items in received:
            assert items == stored

    asyncio.run(scenario())


def _long_poll_in_background(
    pool: concurrent.futures.ThreadPoolExecutor,
    client: httpx.Client,
    url: str,
    after: httpx.Response,
) -> concurrent.futures.Future[httpx.Response]:
    """A long-poll from where ``after`` (a create or append) left the stream, in ``pool``."""
    offset = after.headers["Stream-Next-Offset"]
    return pool.submit(client.get, url, params={"offset": offset, "live": "long-poll"})


def _eventually(condition: Callable[[], bool], failure: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


def test_appends_notify_only_streams_someone_follows(
    two_servers: tuple[Any, Any], database_url: str
) -> None:
    """Watched streams (streams.live): an append to a stream no process follows sends no
    notification; once a reader on process 1 follows it, process 2's appends notify, and the
    reader is woken by them. Notifications arrive in commit order, so once the second append's
    has arrived, one for the first would have arrived before it."""
    first, second = two_servers
    path = f"multiprocess/watched-{time.time_ns()}"
    url_1, url_2 = first.stream_url(path), second.stream_url(path)
    with (
        psycopg.connect(database_url, autocommit=True) as listener,
        httpx.Client(timeout=10) as client,
    ):
        listener.execute("LISTEN ds_streams")
        assert client.put(url_1, headers={"Content-Type": "text/plain"}).status_code == 201
        stream_id, watched = listener.execute(
            "SELECT id, watched_until FROM ds_stream WHERE path = %s", (path,)
        ).fetchone()
        assert watched is None
        unfollowed = client.post(url_2, content=b"a", headers={"Content-Type": "text/plain"})
        assert unfollowed.status_code == 204
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            poll = _long_poll_in_background(pool, client, url_1, unfollowed)
            watched = "SELECT watched_until > now() FROM ds_stream WHERE id = %s"
            _eventually(
                lambda: listener.execute(watched, (stream_id,)).fetchone() == (True,),
                "the long-poll never marked the stream",
            )
            followed = client.post(url_2, content=b"b", headers={"Content-Type": "text/plain"})
            assert followed.status_code == 204
            answer = poll.result(timeout=10)
        assert answer.status_code == 200 and answer.content == b"b"
        mine = []
        for notify in listener.notifies(timeout=10):
            if notify.payload.startswith(f"{stream_id}:"):
                mine.append(notify.payload.split(":")[1])
                break
    assert mine == ["2"]  # the second append's (next seq 2), and nothing before it


def test_readers_joining_while_another_process_appends_miss_nothing(
    two_servers: tuple[Any, Any],
) -> None:
    """A reader's process marks the stream watched before the reader's first read, while the
    other process appends as fast as it can: for ten fresh streams, SSE readers on process 1
    joining mid-stream receive every append made through process 2 (an append committed
    between a read and a missing mark would never reach them)."""
    first, second = two_servers

    async def round_(client: httpx.AsyncClient, number: int) -> None:
        path = f"multiprocess/joining-{time.time_ns()}-{number}"
        url_1, url_2 = first.stream_url(path), second.stream_url(path)
        created = await client.put(url_2, headers=JSON)
        assert created.status_code == 201

        async def writer() -> None:
            for n in range(60):
                body = json.dumps({"n": n})
                answer = await client.post(url_2, content=body, headers=JSON)
                assert answer.status_code == 204
                if n == 10:
                    reader.set()
            closed = await client.post(url_2, headers={"Stream-Closed": "true"})
            assert closed.status_code == 204

        reader = asyncio.Event()
        writing = asyncio.create_task(writer())
        await reader.wait()
        received = await asyncio.wait_for(_sse_until_closed(client, url_1), 15)
        await writing
        assert [item["n"] for item in received] == list(range(60))

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=20) as client:
            for number in range(10):
                await round_(client, number)

    asyncio.run(scenario())


def test_a_reader_reads_only_after_its_stream_is_marked_watched(
    server: Any, database_url: str
) -> None:
    """The order that makes watched streams safe: a reader's mark waits for the appends in
    flight on its stream (their row lock), and the reader reads only after the mark. Here the
    test holds the row lock, appends through it (unmarked: no notification) while a long-poll
    is waiting to mark, and commits: the long-poll must then read that append at once. Had it
    read before its mark, it would have found nothing and waited, unwoken, for its timeout."""
    path = f"multiprocess/mark-order-{time.time_ns()}"
    url = server.stream_url(path)
    with (
        psycopg.connect(database_url, autocommit=True) as holder,
        httpx.Client(timeout=10) as client,
    ):
        created = client.put(url, headers={"Content-Type": "text/plain"})
        assert created.status_code == 201
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM ds_stream WHERE path = %s FOR UPDATE", (path,))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            poll = _long_poll_in_background(pool, client, url, created)
            waiting = (
                "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE 'SELECT ds_watch_streams(%%'"
            )
            with psycopg.connect(database_url, autocommit=True) as observer:
                _eventually(
                    lambda: observer.execute(waiting).fetchone() == (True,),
                    "the long-poll never tried to mark the stream",
                )
            descriptor = '[["text/plain", false, null, null, null, null, 1, 5, null]]'
            (outcome,) = holder.execute(
                "SELECT outcome FROM ds_append(%s, %s::jsonb, '{5}', '{1}', %s, %s)",
                (path, descriptor, b"early", 1 << 30),
            ).fetchone()
            assert outcome == "appended"
            holder.execute("COMMIT")
            answer = poll.result(timeout=10)
    assert answer.status_code == 200 and answer.content == b"early"


def test_an_sse_reader_woken_once_by_an_append_and_a_close_ends_the_stream(
    two_servers: tuple[Any, Any], start_server: Any
) -> None:
    """Another process appends and then closes (a close without data: its notification
    carries no data) while the reader's process is held still, so both notifications reach
    it together and wake the SSE reader once. The reader takes the append from memory and
    must not take that for the whole story: the stream is closed, and the event stream ends
    (before the fix the reader, its wake spent, waited forever)."""
    _, writer = two_servers
    reader = start_server()
    path = f"multiprocess/append-then-close-{time.time_ns()}"
    url_reader, url_writer = reader.stream_url(path), writer.stream_url(path)

    async def scenario() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=20) as client:
            created = await client.put(url_writer, headers=JSON, content=b'{"n": 0}')
            assert created.status_code == 201
            events: asyncio.Queue = asyncio.Queue()
            reading = asyncio.create_task(
                _sse_events(client, url_reader, created.headers["Stream-Next-Offset"], events)
            )
            first = await asyncio.wait_for(events.get(), 5)  # the reader is at the tail
            assert first[0] == "control"
            await asyncio.sleep(0.3)  # ... and waiting
            reader.process.send_signal(signal.SIGSTOP)
            try:
                appended = await client.post(url_writer, content=b'{"n": 1}', headers=JSON)
                assert appended.status_code == 204
                closed = await client.post(url_writer, headers={"Stream-Closed": "true"})
                assert closed.status_code == 204
                await asyncio.sleep(0.3)  # both notifications are on their way
            finally:
                reader.process.send_signal(signal.SIGCONT)
            await asyncio.wait_for(reading, 10)  # the event stream ended
            seen = [first]
            while not events.empty():
                seen.append(events.get_nowait())
            return [(kind, data) for kind, data, _ in seen]

    try:
        seen = asyncio.run(scenario())
    finally:
        reader.stop()
    assert [json.loads(data) for kind, data in seen if kind == "data"] == [[{"n": 1}]]
    assert json.loads(seen[-1][1]).get("streamClosed") is True


def test_readers_get_other_processes_appends_while_nothing_can_be_heard(
    start_server: Any,
) -> None:
    """Probe 10i: with PostgreSQL out of connections, the LISTEN connection could not be made
    again while pooled ones served; appends through another process were acknowledged, and a
    long-poll here answered 204 at the old tail at its timeout, an SSE reader got nothing.
    Readers here now read the store while nothing can be heard. The LISTEN connection of both
    processes goes to a port nobody listens on."""
    env = {
        "DS_DB__LISTEN_URL": f"postgres://postgres@127.0.0.1:{free_port()}/nowhere",
        "DS_SERVER__LONG_POLL_TIMEOUT_SECS": "20",
    }
    reader, writer = start_server(env=env), start_server(env=env)
    path = f"deaf/{time.time_ns()}"

    async def run() -> tuple[httpx.Response, list[tuple[str, str]]]:
        async with httpx.AsyncClient(timeout=30) as http:
            created = await http.put(writer.stream_url(path), headers=JSON)
            assert created.status_code == 201
            tail = created.headers["Stream-Next-Offset"]
            long_poll = asyncio.ensure_future(
                http.get(reader.stream_url(path), params={"offset": tail, "live": "long-poll"})
            )
            events: asyncio.Queue[tuple[str, str, float]] = asyncio.Queue()
            sse = asyncio.ensure_future(_sse_events(http, reader.stream_url(path), tail, events))
            await asyncio.sleep(6)  # both waiting (before, they waited 5 s for LISTEN first)
            appended = await http.post(writer.stream_url(path), headers=JSON, content=b'{"n":1}')
            assert appended.status_code == 204
            answer = await long_poll
            seen: list[tuple[str, str]] = []
            async with asyncio.timeout(15):  # before: nothing until the reconnect interval
                while not any(event == "data" for event, _ in seen):
                    event, data, _ = await events.get()
                    seen.append((event, data))
            sse.cancel()
            return answer, seen

    answer, seen = asyncio.run(run())
    assert answer.status_code == 200, (answer.status_code, dict(answer.headers))
    assert answer.json() == [{"n": 1}]
    assert [json.loads(data) for event, data in seen if event == "data"] == [[{"n": 1}]]
