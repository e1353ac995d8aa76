"""Observability (issue 13): Prometheus metrics summed over a server's worker processes,
request ids and structured request logs, and optional tracing.

A server with two uvicorn workers takes traffic over many connections (the kernel spreads
them over both workers); the scraped figures must equal what was sent, whichever worker
answers the scrape, and both workers must have counted. Workers write their counts every
second (streams.metrics.FLUSH_SECS): scrapes are polled until they settle.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest

from tests.access.support import bearer, create_key
from tests.conftest import ServerProcess

SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape(server: ServerProcess, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The scraped samples: ``name{label="v",...}`` (labels sorted) -> value."""
    response = httpx.get(f"{server.base_url}/metrics", headers=headers or {}, timeout=10)
    assert response.status_code == 200, response.text
    samples = {}
    for line in response.text.splitlines():
        match = SAMPLE.match(line)
        if match is None:
            continue
        labels = ",".join(sorted(match["labels"].split(","))) if match["labels"] else ""
        samples[f"{match['name']}{{{labels}}}"] = float(match["value"])
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    key = ",".join(sorted(f'{k}="{v}"' for k, v in labels.items()))
    return samples.get(f"{name}{{{key}}}", 0.0)


@pytest.fixture(scope="module")
def two_workers(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("metrics")
    server = start_server(
        env={
            "DS_METRICS__DIR": str(directory),
            "DS_LOG__FORMAT": "json",
            "DS_LOG_LEVEL": "INFO",
        },
        workers=2,
    )
    server.metrics_directory = directory
    return server


def test_metrics_sum_both_workers(two_workers: ServerProcess) -> None:
    """Requests by route, method and status, appends and their bytes, catch-up bytes: the
    scraped figures match what was sent through both worker processes."""
    server = two_workers
    tag = f"metrics-{time.time_ns()}"
    before = scrape(server)
    per_round, body = 200, b"m" * 37
    directory = Path(server.metrics_directory)  # type: ignore[attr-defined]

    async def traffic(*, first: bool, last: bool) -> int:
        """A round of appends, each on a connection of its own (the kernel chooses the
        worker); the first round creates the stream, the last reads it back."""
        connector = aiohttp.TCPConnector(limit=40, force_close=True)
        async with aiohttp.ClientSession(base_url=server.base_url, connector=connector) as http:
            if first:
                headers = {"Content-Type": "text/plain"}
                async with http.put(f"/v1/stream/{tag}", headers=headers) as r:
                    assert r.status == 201

            async def append() -> None:
                async with http.post(
                    f"/v1/stream/{tag}", data=body, headers={"Content-Type": "text/plain"}
                ) as response:
                    assert response.status == 204

            await asyncio.gather(*(append() for _ in range(per_round)))
            if not last:
                return 0
            missing = await asyncio.gather(
                *(http.get(f"/v1/stream/{tag}-missing") for _ in range(30))
            )
            assert {r.status for r in missing} == {404}
            async with http.get(f"/v1/stream/{tag}", params={"offset": "-1"}) as response:
                return len(await response.read())

    def counted(appends: int, missing: int = 0, read: int = 0) -> tuple[dict[str, float], bool]:
        """The scrape once it counts every append, its answer and its duration (and ``missing``
        404s and ``read`` catch-up bytes: each worker's figures arrive with its next snapshot,
        and an append is counted before its answer is), and whether both workers took appends
        (each one's snapshot counts some; given two seconds to say so)."""
        started = time.monotonic()
        deadline = started + 10
        not_found = {"route": "stream", "method": "GET", "status": "404"}
        answered = {"route": "stream", "method": "POST", "status": "204"}
        expected = [
            ("ds_appends_total", {"outcome": "appended"}, appends),
            ("ds_http_requests_total", answered, appends),
            ("ds_append_duration_seconds_count", {}, appends),
            ("ds_http_requests_total", not_found, missing),
            ("ds_catch_up_bytes_total", {}, read),
        ]
        while True:
            after = scrape(server)
            appended = value(after, "ds_appends_total", outcome="appended")
            if all(
                value(after, name, **labels) - value(before, name, **labels) >= count
                for name, labels, count in expected
            ):
                workers = sum(_appended_in(path) > 0 for path in directory.glob("*.json"))
                if workers >= 2 or time.monotonic() > started + 2:
                    return after, workers >= 2
            assert time.monotonic() < deadline, (appended, list(directory.glob("*")))
            time.sleep(0.2)

    # On a busy machine one worker may accept every connection of a round: another round
    # then, until both have taken appends.
    appends = 0
    for round_ in range(5):
        asyncio.run(traffic(first=round_ == 0, last=False))
        appends += per_round
        after, both = counted(appends)
        if both:
            break
    assert both, "one worker took every append of five rounds"
    read = asyncio.run(traffic(first=False, last=True))
    appends += per_round
    after, _ = counted(appends, missing=30, read=read)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("ds_http_requests_total", route="stream", method="POST", status="204") == appends
    assert delta("ds_http_requests_total", route="stream", method="GET", status="404") == 30
    assert delta("ds_http_requests_total", route="stream", method="PUT", status="201") == 1
    assert delta("ds_appends_total", outcome="appended") == appends
    assert delta("ds_append_bytes_total") == appends * len(body)
    assert delta("ds_catch_up_bytes_total") == read == appends * len(body)
    assert delta("ds_group_commit_batch_requests_sum") == appends
    assert delta("ds_append_duration_seconds_count") == appends
    assert value(after, "ds_db_pool_connections", state="open") >= 0


def _appended_in(snapshot: Path) -> float:
    """Appends counted in one worker's snapshot (streams.metrics.flush)."""
    for name, _, _, samples in json.loads(snapshot.read_text()):
        if name == "ds_appends":
            return sum(v for n, labels, v in samples if labels.get("outcome") == "appended")
    return 0.0


def test_live_reader_gauge_goes_up_then_down(two_workers: ServerProcess) -> None:
    server = two_workers
    url = server.stream_url(f"metrics-live-{time.time_ns()}")
    assert httpx.put(url, headers={"Content-Type": "text/plain"}).status_code == 201

    def readers() -> tuple[float, float]:
        samples = scrape(server)
        return (
            value(samples, "ds_live_readers", mode="sse"),
            value(samples, "ds_live_readers", mode="long-poll"),
        )

    async def scenario() -> tuple[tuple[float, float], tuple[float, float]]:
        connector = aiohttp.TCPConnector(limit=40, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            sse = [await http.get(url, params={"offset": "now", "live": "sse"}) for _ in range(5)]
            polls = [
                asyncio.ensure_future(http.get(url, params={"offset": "now", "live": "long-poll"}))
                for _ in range(3)
            ]
            deadline = time.monotonic() + 10
            while (during := await asyncio.to_thread(readers)) != (5, 3):
                assert time.monotonic() < deadline, during
                await asyncio.sleep(0.1)
            for response in sse:
                response.close()
            for poll in polls:
                poll.cancel()
            deadline = time.monotonic() + 10
            while (after := await asyncio.to_thread(readers)) != (0, 0):
                assert time.monotonic() < deadline, after
                await asyncio.sleep(0.1)
            return during, after

    marks = {"reason": "subscribe", "outcome": "marked"}
    before = value(scrape(server), "ds_watch_marks_total", **marks)
    during, after = asyncio.run(scenario())
    assert during == (5, 3) and after == (0, 0)
    # Eight readers of one stream on two processes: each process marks it once (streams.live).
    deadline = time.monotonic() + 10
    while (marked := value(scrape(server), "ds_watch_marks_total", **marks) - before) < 1:
        assert time.monotonic() < deadline, "no watch mark counted"
        time.sleep(0.1)
    assert marked <= 2


def test_request_ids_and_structured_logs(two_workers: ServerProcess) -> None:
    """One JSON line per request with the request id (taken from X-Request-Id or generated,
    returned in the response), the route, the status and the duration; never a body or a
    credential."""
    server = two_workers
    url = server.stream_url(f"metrics-logs-{time.time_ns()}")
    given = httpx.put(
        url,
        headers={"Content-Type": "text/plain", "X-Request-Id": "abc-123.x"} | bearer("secretkey"),
        content="SECRETBODY",
    )
    assert given.status_code == 201
    assert given.headers["X-Request-Id"] == "abc-123.x"
    generated = httpx.head(url).headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{16}", generated)
    hostile = httpx.head(url, headers={"X-Request-Id": "x" * 300}).headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{16}", hostile)

    deadline = time.monotonic() + 10
    while True:
        log = server.log_path.read_text()
        lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        mine = [line for line in lines if line.get("request_id") in ("abc-123.x", generated)]
        if len(mine) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    by_id = {line["request_id"]: line for line in mine if line["logger"] == "ds.request"}
    assert by_id["abc-123.x"]["status"] == 201 and by_id["abc-123.x"]["route"] == "stream"
    assert by_id[generated]["status"] == 200 and "duration_ms" in by_id[generated]
    assert "SECRETBODY" not in log and "secretkey" not in log


def test_request_lines_are_all_written_when_the_server_stops(start_server: Any) -> None:
    """Request lines are logged in batches a moment after their requests
    (streams.http.observe.RequestLines): a server stopped right after answering still writes
    every one, each with its own request's id, status and time."""
    server = start_server(env={"DS_LOG__FORMAT": "json", "DS_LOG_LEVEL": "INFO"}, workers=2)
    url = server.stream_url(f"request-lines-{time.time_ns()}")
    sent = {}
    with httpx.Client() as client:
        assert client.put(url, headers={"Content-Type": "text/plain"}).status_code == 201
        for number in range(40):
            began = time.time()
            answer = client.post(
                url,
                headers={"Content-Type": "text/plain", "X-Request-Id": f"line-{number}"},
                content=b"x",
            )
            assert answer.status_code == 204
            sent[f"line-{number}"] = (began, time.time())
    server.stop()
    lines = [json.loads(line) for line in server.log_path.read_text().splitlines()
             if line.startswith("{")]  # fmt: skip
    logged = {line["request_id"]: line for line in lines if line["logger"] == "ds.request"}
    assert set(sent) <= set(logged)
    for rid, (began, answered) in sent.items():
        line = logged[rid]
        assert (line["status"], line["route"]) == (204, "stream")
        assert line["message"] == f"POST {urlsplit(url).path} 204"
        when = datetime.fromisoformat(line["time"]).timestamp()
        # The time the answer began (truncated to the millisecond), not of the batch's writing:
        # after the client sent the request and before it had the answer (one clock).
        assert began - 0.001 <= when <= answered


def test_metrics_need_a_grant_in_keys_mode(start_server: Any, database_url: str) -> None:
    server = start_server(env={"DS_AUTH__MODE": "keys"})
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401
    reader = create_key(database_url, "streams-only", "stream/:read")
    assert httpx.get(f"{server.base_url}/metrics", headers=bearer(reader)).status_code == 403
    monitor = create_key(database_url, "monitor", "metrics:read")
    assert scrape(server, bearer(monitor))  # Prometheus text, parsed


def test_tracing_is_on_only_when_asked(start_server: Any) -> None:
    """OTEL_TRACES_EXPORTER=console: requests and their statements become spans (printed);
    without OTEL_* variables nothing is traced."""
    server = start_server(env={"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "ds-test"})
    url = server.stream_url(f"traced-{time.time_ns()}")
    assert httpx.put(url, headers={"Content-Type": "text/plain"}).status_code == 201
    # An append's statement runs without psycopg's cursors (streams.store.prepared): a span too.
    assert httpx.post(url, content=b"x", headers={"Content-Type": "text/plain"}).status_code == 204
    deadline = time.monotonic() + 10
    while "FROM ds_append(" not in server.log_path.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    log = server.log_path.read_text()
    assert '"service.name": "ds-test"' in log
    assert '"db.system"' in log and "ds_create" in log
    plain = start_server()
    httpx.put(
        plain.stream_url(f"untraced-{time.time_ns()}"), headers={"Content-Type": "text/plain"}
    )
    assert "service.name" not in plain.log_path.read_text()
