"""Limits on live reads (streams.live_readers): one client (an API key with its signed URLs,
or in open mode an address) may hold only so many long-polls and SSE connections per process
(429), and a process only so many in all (503), so that nobody can take every descriptor of a
process. A refused read does nothing; a client that lets one go may open another.

One server process each, so that every connection of a test meets the same counts."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.access.support import bearer, create_key
from tests.conftest import ServerProcess
from tests.http.test_observability import scrape, value

TEXT = {"Content-Type": "text/plain"}


def _follow(http: httpx.Client, url: str, **headers: str) -> httpx.Response:
    """An SSE connection kept open (its answer's head received); close it to let it go."""
    joined = f"{url}{'&' if '?' in url else '?'}offset=-1&live=sse"
    return http.send(http.build_request("GET", joined, headers=headers), stream=True)


@contextlib.contextmanager
def _following(
    http: httpx.Client, url: str, count: int, **headers: str
) -> Iterator[list[httpx.Response]]:
    """``count`` SSE connections to ``url``, each admitted (200), closed at the end."""
    held: list[httpx.Response] = []
    try:
        for _ in range(count):
            held.append(_follow(http, url, **headers))
            assert held[-1].status_code == 200, held[-1].read()
        yield held
    finally:
        for response in held:
            response.close()


def _admitted_again(http: httpx.Client, url: str, **headers: str) -> httpx.Response:
    """A new SSE connection once the server has noticed one let go (it hears the close)."""
    deadline = time.monotonic() + 10
    while (response := _follow(http, url, **headers)).status_code != 200:
        response.close()
        assert time.monotonic() < deadline, "a live read let go was never given back"
        time.sleep(0.1)
    return response


def _refused(response: httpx.Response, status: int) -> None:
    body = response.read().decode()
    assert response.status_code == status, body
    assert response.headers["Retry-After"] == "1"
    response.close()


@pytest.fixture(scope="module")
def keys_server(start_server: Any) -> ServerProcess:
    return start_server(env={"DS_AUTH__MODE": "keys", "DS_LIVE__MAX_PER_CLIENT": "3"})


def test_a_key_holds_only_so_many_live_reads(keys_server: ServerProcess, database_url: str) -> None:
    """A key past its live reads is refused (SSE and long-poll, with its signed URLs too), with
    nothing done; another key is not; one let go may be taken again."""
    mine = bearer(create_key(database_url, "live-limit-a", "stream/limits/:read,append,manage"))
    other = bearer(create_key(database_url, "live-limit-b", "stream/limits/:read"))
    monitor = bearer(create_key(database_url, "live-limit-monitor", "metrics:read"))
    url = keys_server.stream_url(f"limits/{time.time_ns()}")
    with httpx.Client(timeout=10) as http:
        assert http.put(url, headers=mine | TEXT, content="x").status_code == 201
        minted = http.post(
            f"{keys_server.base_url}/v1/auth/signed-urls",
            json={"stream": url.split("/v1/stream/", 1)[1]},
            headers=mine,
        )
        assert minted.status_code == 201, minted.text
        before = value(scrape(keys_server, monitor), "ds_live_refusals_total", limit="client")
        with _following(http, url, 3, **mine) as held:
            _refused(_follow(http, url, **mine), 429)
            poll = http.get(url, params={"offset": "now", "live": "long-poll"}, headers=mine)
            assert poll.status_code == 429, poll.text
            _refused(_follow(http, minted.json()["url"]), 429)
            # A missing stream is refused as well: the limit comes before any lookup.
            _refused(_follow(http, f"{url}-missing", **mine), 429)
            with _following(http, url, 3, **other):
                pass
            held.pop().close()
            _admitted_again(http, url, **mine).close()
        refused = value(scrape(keys_server, monitor), "ds_live_refusals_total", limit="client")
        assert refused - before >= 4
        # Nothing of the refused reads was kept: the stream is as it was.
        assert http.get(url, params={"offset": "-1"}, headers=mine).text == "x"


def test_in_open_mode_an_address_holds_only_so_many_live_reads(start_server: Any) -> None:
    server = start_server(env={"DS_LIVE__MAX_PER_CLIENT": "2"})
    url = server.stream_url(f"limits/open-{time.time_ns()}")
    elsewhere = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(timeout=10) as http, httpx.Client(timeout=10, transport=elsewhere) as other:
        assert http.put(url, headers=TEXT).status_code == 201
        with _following(http, url, 2):
            _refused(_follow(http, url), 429)
            with _following(other, url, 2):
                _refused(_follow(other, url), 429)


def test_a_full_process_refuses_live_reads_until_one_ends(start_server: Any) -> None:
    server = start_server(env={"DS_LIVE__MAX_PER_CLIENT": "0", "DS_LIVE__MAX_READERS": "3"})
    url = server.stream_url(f"limits/full-{time.time_ns()}")
    with httpx.Client(timeout=10) as http:
        assert http.put(url, headers=TEXT).status_code == 201
        with _following(http, url, 3) as held:
            _refused(_follow(http, url), 503)
            # Everything else goes on being answered.
            assert http.post(url, headers=TEXT, content="y").status_code == 204
            assert http.get(url, params={"offset": "-1"}).text == "y"
            held.pop().close()
            _admitted_again(http, url).close()
        assert value(scrape(server), "ds_live_refusals_total", limit="process") == 1


def test_a_yjs_services_secret_is_counted_in_the_process_only(start_server: Any) -> None:
    """A Yjs service's secret is the operator's own backend, or every client of the service at
    once: its live reads count in the process's total, not against a client's limit."""
    server = start_server(
        env={"DS_LIVE__MAX_PER_CLIENT": "2", "YJS_SERVICE_SECRETS": "limits=limits-secret"}
    )
    url = f"{server.base_url}/v1/yjs/limits/docs/doc-{time.time_ns()}"
    secret = {"Authorization": "Bearer limits-secret"}
    with httpx.Client(timeout=10) as http:
        assert http.put(url, headers=secret).status_code == 201
        with _following(http, url, 4, **secret):
            pass
