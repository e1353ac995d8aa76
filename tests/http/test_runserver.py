"""`python manage.py runserver` (daphne) serves the whole protocol, not only the production
server: the README's walk-through runs against it."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx


def test_runserver_serves_create_append_read_sse_delete(start_server: Any) -> None:
    server = start_server(kind="runserver")
    url = server.stream_url(f"runserver/{time.time_ns()}")
    with httpx.Client(timeout=10) as client:
        created = client.put(url, headers={"Content-Type": "text/plain"}, content="hello")
        assert created.status_code == 201
        appended = client.post(url, headers={"Content-Type": "text/plain"}, content=" world")
        assert appended.status_code == 204
        read = client.get(url, params={"offset": "-1"})
        assert read.text == "hello world"
        assert read.headers["Stream-Up-To-Date"] == "true"

        lines: list[str] = []

        def follow() -> None:
            params = {"offset": read.headers["Stream-Next-Offset"], "live": "sse"}
            with httpx.stream("GET", url, params=params, timeout=10) as response:
                assert response.headers["Content-Type"] == "text/event-stream"
                for line in response.iter_lines():
                    lines.append(line)
                    if line == "data:!":
                        return

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reader = pool.submit(follow)
            time.sleep(0.5)
            client.post(url, headers={"Content-Type": "text/plain"}, content="!")
            reader.result(timeout=5)  # the reader's own failures fail the test
        assert "data:!" in lines

        poll = client.get(url, params={"offset": "now", "live": "long-poll"})
        assert poll.status_code == 204  # the 2 s timeout of the test servers
        assert client.delete(url).status_code == 204
        assert client.get(url).status_code == 404
        assert client.get(f"{server.base_url}/healthz").json()["status"] == "ok"
