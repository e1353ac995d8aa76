"""JSON Schemas from clients are input too (STATE-PROTOCOL.md 7; POST /v1/state/streams needs
only the right to manage the stream): a schema may not make the server fetch anything, and
no value judged against it may stall a worker or answer 500 (state/core/schemas.py).

Found by an adversarial probe: a ``$ref`` to a URL or a file was fetched, at registration and
again when explaining a refused value, and what came back was shown in the 400; a ``pattern``
with nested quantifiers ran Python's backtracking ``re`` on the value (one append kept a worker
busy until uvicorn killed it); and a recursive schema explained a deeply nested value by
recursing in Python (500).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.state.support import append, append_ok, change, create_json_stream, register

# What a request may take before the test calls it stalled: generous on a loaded machine, and
# far below what the backtracking took (minutes for these inputs).
STALLED_SECS = 30.0


@pytest.fixture(scope="module")
def own_client(start_server: object) -> Iterator[httpx.Client]:
    """A server of this module's own: before the fix, a stalled worker would have kept every
    other test's requests waiting."""
    server: ServerProcess = start_server()  # type: ignore[operator]
    with httpx.Client(base_url=server.base_url, timeout=STALLED_SECS) as http:
        yield http


@pytest.mark.parametrize("pattern", ["^(a+)+$", "^(a|aa)+$"], ids=["nested", "alt"])
def test_a_backtracking_pattern_is_judged_at_once(
    own_client: httpx.Client, stream_path: str, pattern: str
) -> None:
    """A value that makes a backtracking engine try every split of its 40 characters is
    refused (400) in an ordinary request, and the worker goes on answering."""
    create_json_stream(own_client, stream_path)
    schema = {"type": "object", "properties": {"w": {"type": "string", "pattern": pattern}}}
    assert register(own_client, stream_path, {"t": schema}).status_code == 201
    response = append(own_client, stream_path, [change("t", "k", {"w": "a" * 40 + "!"})])
    assert response.status_code == 400, response.text
    assert "does not match its schema" in response.text
    append_ok(own_client, stream_path, [change("t", "k", {"w": "a" * 40})])


def test_patterns_only_a_backtracking_engine_runs_are_refused(
    own_client: httpx.Client, stream_path: str
) -> None:
    """Lookaround and backreferences need a backtracking engine, whose step limit bounds one
    match (45 ms), not a value: 100 strings under ``anyOf`` took 4.7 s (found by review). Such
    patterns are refused at registration (400), in ``pattern`` and ``patternProperties``."""
    create_json_stream(own_client, stream_path)
    for schema in (
        {"items": {"anyOf": [{"pattern": "^(a|a)*\\1b$"}, {"type": "string"}]}},
        {"type": "string", "pattern": "^(?=a)(a+)+$"},
        {"patternProperties": {"^(?!x)": {"type": "integer"}}},
    ):
        response = register(own_client, stream_path, {"t": schema})
        assert response.status_code == 400, (schema, response.text)


def test_a_schema_may_not_refer_to_other_documents(
    own_client: httpx.Client, stream_path: str
) -> None:
    """A ``$ref`` to a URL (here a listener of the test's own) or to a file is refused at
    registration (400), and the server connects to nothing."""
    create_json_stream(own_client, stream_path)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        for ref in (f"http://127.0.0.1:{port}/secret.json", "file:///etc/hostname"):
            response = register(own_client, stream_path, {"t": {"$ref": ref}})
            assert response.status_code == 400, response.text
            assert "cannot be used" in response.text
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_a_value_nested_past_what_the_validator_checks_is_refused(
    own_client: httpx.Client, stream_path: str
) -> None:
    """A recursive schema refusing every level of a value nested 900 arrays deep (the JSON
    limit is 1,000): a 400 saying the value cannot be checked, not a 500."""
    create_json_stream(own_client, stream_path)
    schema = {
        "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 0}},
        "$ref": "#/$defs/n",
    }
    assert register(own_client, stream_path, {"t": schema}).status_code == 201
    nested: list = []
    for _ in range(900):
        nested = [nested]
    response = append(own_client, stream_path, [change("t", "k", nested)])
    assert response.status_code == 400, response.text
    assert "cannot be checked" in response.text
    append_ok(own_client, stream_path, [change("t", "k", [])])
