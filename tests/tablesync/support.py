"""Helpers shared by the table sync tests: operator commands, tables, stream reads (catch-up and
SSE), and the state a table or a stream stands for."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
from psycopg import sql

from tests.conftest import manage
from tests.state.support import model, read_messages
from tests.yjs.support import sse_events

# How long a condition that the server reaches by itself may take (generous: a shared machine).
DEADLINE_SECS = 90.0


def command_ok(database_url: str, *args: str) -> str:
    """Run a management command that must succeed; returns its output."""
    result = manage(database_url, *args)
    assert result.returncode == 0, f"{args}: {result.stderr}{result.stdout}"
    return result.stdout


def command_fails(database_url: str, *args: str) -> str:
    """Run a management command that must be refused; returns its error output."""
    result = manage(database_url, *args)
    assert result.returncode == 1, f"{args} did not fail: {result.stdout}"
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


def wait_until(condition: Callable[[], Any], what: str, deadline: float = DEADLINE_SECS) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < end, f"not reached within {deadline} s: {what}"
        time.sleep(0.05)


def table_state(pg: psycopg.Connection[Any], table: str, entity_type: str, key: str = "id") -> dict:
    """A table as the State Protocol state it should equal: (type, key) -> the row as JSON."""
    rows = pg.execute(
        sql.SQL("SELECT {}::text, to_jsonb(t) FROM {} AS t").format(
            sql.Identifier(key), sql.Identifier(table)
        )
    ).fetchall()
    return {(entity_type, k): v for k, v in rows}


def stream_state(client: httpx.Client, path: str) -> tuple[dict, list[Any], str]:
    """The state the stream's events materialize to (tests/state/support.model), the
    events, and the tail offset."""
    messages, tail = read_messages(client, path)
    return model(messages), messages, tail


def entities_state(entities: list[dict[str, Any]]) -> dict:
    """A reference client's report (tests/js/state/*.mjs) as the same mapping."""
    return {(e["type"], e["key"]): e["value"] for e in entities}


class SseReader(threading.Thread):
    """Reads a stream over SSE from ``offset`` in a thread, until a control event reports
    ``target`` (set it later with ``until``); collects the messages of the data events."""

    def __init__(self, base_url: str, path: str, offset: str = "-1") -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/v1/stream/{path}"
        self.offset = offset
        self.messages: list[Any] = []
        self.offsets: list[str] = []
        self.requests = 0
        self.connected = threading.Event()
        self._target: str | None = None
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.error: Exception | None = None

    def until(self, target: str) -> None:
        with self._lock:
            self._target = target
            if self.offsets and self.offsets[-1] >= target:
                self.done.set()

    def run(self) -> None:
        try:
            self._read()
        except Exception as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
        finally:
            self.done.set()

    def _read(self) -> None:
        offset = self.offset
        with httpx.Client(timeout=httpx.Timeout(30, read=70)) as client:
            while True:
                self.requests += 1
                params = {"offset": offset, "live": "sse"}
                with client.stream("GET", self.url, params=params) as response:
                    assert response.status_code == 200, response.status_code
                    self.connected.set()
                    for event in sse_events(response.iter_lines()):
                        if event.kind == "data":
                            self.messages.extend(json.loads(event.data))
                        elif event.kind == "control":
                            offset = event.control["streamNextOffset"]
                            with self._lock:
                                self.offsets.append(offset)
                                if self._target is not None and offset >= self._target:
                                    self.done.set()
                                    return
                # The server ended the response (its reconnect interval): go on from offset.

    def result(self, timeout: float = DEADLINE_SECS) -> list[Any]:
        """The messages up to the target (the thread may stay blocked on its response until
        the server ends it; it is a daemon)."""
        assert self.done.wait(timeout), "the SSE reader did not reach its target"
        if self.error is not None:
            raise self.error
        with self._lock:
            return list(self.messages)


def csrf(client: httpx.Client, url: str) -> str:
    page = client.get(url)
    assert page.status_code == 200, page.text[:500]
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None
    return token.group(1)
