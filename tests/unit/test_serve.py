"""The request loop every lean endpoint shares (``streams.http.app.serve``), driven as an ASGI
server drives it.

Defect 11 of issue 8: an error after an SSE response began sent a second response start (an
ASGI RuntimeError in the server, a broken response for the client). Once a response began, an
error ends it; it is never replaced.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from durable_project.logs import JsonFormatter, RequestIdFilter, TextFormatter
from streams import lifecycle, metrics
from streams.errors import NotFound
from streams.http import health, observe, responses
from streams.http.app import serve

pytestmark = pytest.mark.django_db(databases=[])


def _scope(method: str = "GET") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": "/v1/stream/x",
        "raw_path": b"/v1/stream/x",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
    }


async def _drive(handler: Any, method: str = "GET") -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    gate = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gate.wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if sent and sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body"):
            raise RuntimeError("message after the response ended")
        if message["type"] == "http.response.start" and any(
            m["type"] == "http.response.start" for m in sent
        ):
            raise RuntimeError("second response start")
        sent.append(message)

    try:
        await serve(_scope(method), receive, send, handler)
    finally:
        # serve() starts the process's background work, as a server's first request does; it
        # stops as a server's does (the database pool's workers outlive a loop left open).
        await lifecycle.shutdown()
    return sent


def _streaming_then(error: Exception) -> Any:
    async def handler(scope: Any, receive: Any, send: Any, origin: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"event: data\n", "more_body": True})
        raise error

    return handler


@pytest.mark.parametrize("error", [RuntimeError("boom"), NotFound("gone"), ValueError("x")])
def test_error_after_the_response_began_ends_it(error: Exception) -> None:
    sent = asyncio.run(_drive(_streaming_then(error)))
    assert [m["type"] for m in sent] == [
        "http.response.start",
        "http.response.body",
        "http.response.body",
    ]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_error_before_the_response_is_answered() -> None:
    async def handler(scope: Any, receive: Any, send: Any, origin: Any) -> None:
        raise RuntimeError("boom")

    sent = asyncio.run(_drive(handler, method="POST"))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    assert sent[-1].get("more_body", False) is False


@given(st.lists(st.binary(max_size=300_000), max_size=40))
def test_a_read_in_pieces_goes_out_whole_in_blocks(pieces: list[bytes]) -> None:
    """A large read's pieces are sent joined into blocks of about BLOCK_BYTES: the same bytes in
    the same order, every block but the last at least BLOCK_BYTES long."""
    blocks = list(responses._blocks(pieces))
    assert b"".join(blocks) == b"".join(pieces)
    assert all(len(block) >= responses.BLOCK_BYTES for block in blocks[:-1])
    assert 1 <= len(blocks) <= max(1, len(pieces))


def test_request_lines_noted_on_a_loop_that_closed_are_logged_by_the_next() -> None:
    """A flush scheduled on an event loop that closes before it runs never runs: lines noted
    later, on another loop, must still be logged within the delay (with those before them)."""
    logger = logging.getLogger(f"tests.request-lines.{id(object())}")
    logger.propagate = False
    handler = _Collect()
    logger.addHandler(handler)
    lines = observe.RequestLines(logger)

    async def one(rid: str, wait: float) -> None:
        lines.note(rid, "POST", "/v1/stream/a", 204, "stream", 0.001, time.time())
        await asyncio.sleep(wait)

    asyncio.run(one("first", 0))  # the loop closes before its flush is due
    asyncio.run(one("second", observe.LINE_DELAY_SECS * 4))
    assert [record.request_id for record in handler.records] == ["first", "second"]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("formatter", [TextFormatter, JsonFormatter])
def test_request_lines_written_directly_are_what_logging_writes(formatter: type[Any]) -> None:
    """With the project's logging (one console handler on the parent logger), request lines
    are formatted and written in one go, without records (RequestLines._write_directly): the
    text must be exactly what logging itself writes for them."""
    lines = [
        ("abc123", "POST", "/v1/stream/a", 204, "stream", 0.0012345, 1_800_000_000.0005),
        ("d-2", "GET", "/v1/stream/%41 ü/x", 200, "stream", 1.5, 1_800_000_000.9999),
        ("-", "PUT", "/admin/", 499, "admin", 0.0, 1_800_000_001.25),
    ]

    def written(direct: bool) -> str:
        parent = logging.getLogger(f"tests.request-lines.{uuid.uuid4().hex}")
        parent.propagate = False
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(formatter())
        handler.addFilter(RequestIdFilter())
        parent.addHandler(handler)
        if not direct:
            handler.addFilter(lambda record: True)  # any other filter: records are made
        logger = logging.getLogger(f"{parent.name}.request")
        logger.setLevel(logging.INFO)
        request_lines = observe.RequestLines(logger)
        request_lines._lines = list(lines)
        assert observe._sole_console_handler(logger) is (handler if direct else None)
        request_lines.flush()
        return stream.getvalue().replace(logger.name, "ds.request")

    direct = written(direct=True)
    assert direct == written(direct=False)
    assert len(direct.splitlines()) == 3 and "stream" in direct


def test_a_head_the_connection_refused_counts_as_a_server_error() -> None:
    """Probe 10e: a response head the connection refused to send (uvicorn refuses a header
    value with a line break or U+2028) was counted and logged with the status it would have
    had (200), though the client got no answer at all. It counts as 500 now."""
    route = f"refused-{uuid.uuid4().hex[:8]}"

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def refusing_send(message: dict[str, Any]) -> None:
        raise RuntimeError("Invalid HTTP header value.")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    with pytest.raises(RuntimeError):
        asyncio.run(observe.observed(app, route)(_scope(), receive, refusing_send))
    observe.request_lines.flush()  # its line, now: not at exit, into a closed capture
    counted = {
        dict(labels)["status"]: value
        for (name, labels), value in metrics.totals(frozenset({"ds_http_requests_total"})).items()
        if dict(labels)["route"] == route
    }
    assert counted == {"500": 1.0}


def test_scrapes_at_once_share_one_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe 10e: each /metrics scrape rendered the exposition in a thread of its own, so 32
    connections scraping took the default thread pool (large bodies are decoded and tokens
    checked there) and made another client's appends 17 times slower. Scrapes that arrive
    while one renders share its text; the next one renders again."""
    renders = 0

    def slow_exposition() -> tuple[bytes, str]:
        nonlocal renders
        renders += 1
        time.sleep(0.2)
        return f"render {renders}\n".encode(), "text/plain"

    monkeypatch.setattr(health.metrics, "exposition", slow_exposition)

    async def scrape() -> bytes:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = _scope() | {"path": "/metrics", "raw_path": b"/metrics"}
        await health.metrics_app(scope, receive, send)
        return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    async def main() -> tuple[list[bytes], bytes]:
        together = await asyncio.gather(*(scrape() for _ in range(10)))
        return together, await scrape()

    together, after = asyncio.run(main())
    assert together == [b"render 1\n"] * 10
    assert after == b"render 2\n"
