"""Retention policies, enforced by the server's sweep and by ``manage.py trim_streams``
(PROTOCOL.md 4: servers MAY drop data older than an age while the stream continues; the
policy headers are extensions, docs/gaps.md, Retention)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, command_env, manage
from tests.retention.support import (
    JSON,
    TEXT,
    append_all,
    create,
    eventually,
    head,
    read_text,
    start_of,
    stored_seqs,
    url,
)
from tests.state.support import change, register_ok

# The sweep runs often here, so policies take effect within a test.
SWEEPING = {"DS_RETENTION__SWEEP_INTERVAL_SECS": "0.2"}


@pytest.fixture(scope="module")
def sweeping(start_server: Any) -> Iterator[ServerProcess]:
    server = start_server(env=SWEEPING)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def defaulted(start_server: Any) -> Iterator[ServerProcess]:
    """A server whose streams keep 64 bytes unless they say otherwise. Its sweep trims every
    stream of the test database that sets no policy: stopped when this module is done."""
    server = start_server(env=SWEEPING | {"DS_RETENTION__MAX_BYTES": "64"})
    yield server
    server.stop()


@pytest.fixture
def on_sweeping(sweeping: ServerProcess) -> Any:
    with httpx.Client(base_url=sweeping.base_url, timeout=30) as http:
        yield http


def moved_past(client: httpx.Client, path: str, offset: str) -> str | None:
    start = start_of(client, path)
    return start if start >= offset else None


def test_size_retention_keeps_the_newest_bytes(on_sweeping: httpx.Client, stream_path: str) -> None:
    """Stream-Retention-Max-Bytes: the sweep trims the oldest messages until what is retained
    fits, at a message boundary; the newest messages stay, at their offsets."""
    client = on_sweeping
    create(client, stream_path, {"Stream-Retention-Max-Bytes": "100"})
    assert head(client, stream_path)["stream-retention-max-bytes"] == "100"
    messages = [f"{i:03d}" + "x" * 27 for i in range(10)]  # 30 bytes each
    offsets = append_all(client, stream_path, messages)
    # 100 bytes hold the newest three messages (90 bytes) but not four (120).
    start = eventually(lambda: moved_past(client, stream_path, offsets[7]), what="size trim")
    assert start == offsets[7]
    assert read_text(client, stream_path) == ("".join(messages[7:]), offsets[-1])
    assert client.get(url(stream_path), params={"offset": offsets[6]}).status_code == 410


def test_age_retention_drops_old_messages_and_keeps_recent_ones(
    on_sweeping: httpx.Client, stream_path: str, pg: Any
) -> None:
    """Stream-Retention-Max-Age: messages appended before the age are trimmed by the sweep
    (and their rows deleted); messages appended since are kept, and the stream goes on."""
    client = on_sweeping
    create(client, stream_path, {"Stream-Retention-Max-Age": "2"})
    old = append_all(client, stream_path, ["old-1;", "old-2;"])
    eventually(lambda: moved_past(client, stream_path, old[-1]), what="age trim")
    assert read_text(client, stream_path)[0] == ""
    # Fresh messages are younger than the age: the next sweeps keep them.
    fresh = append_all(client, stream_path, ["new-1;", "new-2;"])
    assert read_text(client, stream_path) == ("new-1;new-2;", fresh[-1])
    assert client.get(url(stream_path), params={"offset": old[0]}).status_code == 410
    # The old rows are deleted (the fresh ones may have aged out meanwhile on a slow machine).
    eventually(lambda: all(seq >= 2 for seq in stored_seqs(pg, stream_path)) or None, what="purge")


def test_policies_are_part_of_the_configuration(
    on_sweeping: httpx.Client, stream_path: str
) -> None:
    """PROTOCOL.md 5.1: a PUT of an existing stream with another configuration is 409. A
    retention policy the PUT gives must match; one it does not give is not compared."""
    client = on_sweeping
    policy = {"Stream-Retention-Max-Age": "86400", "Stream-Retention-Max-Bytes": "4096"}
    create(client, stream_path, policy)
    assert client.put(url(stream_path), headers=TEXT | policy).status_code == 200
    assert client.put(url(stream_path), headers=TEXT).status_code == 200
    other = policy | {"Stream-Retention-Max-Bytes": "4097"}
    assert client.put(url(stream_path), headers=TEXT | other).status_code == 409
    headers = head(client, stream_path)
    assert headers["stream-retention-max-age"] == "86400"
    assert headers["stream-retention-max-bytes"] == "4096"


@pytest.mark.parametrize(
    "header",
    [
        {"Stream-Retention-Max-Age": "0"},
        {"Stream-Retention-Max-Age": "-5"},
        {"Stream-Retention-Max-Age": "1.5"},
        {"Stream-Retention-Max-Bytes": "01"},
        {"Stream-Retention-Max-Bytes": "1e6"},
        {"Stream-Retention-Max-Bytes": "99999999999999999999"},
        {"Stream-Retention-Max-Age": "9999999999999"},
    ],
)
def test_bad_policies_are_refused(
    on_sweeping: httpx.Client, stream_path: str, header: dict[str, str]
) -> None:
    response = on_sweeping.put(url(stream_path), headers=TEXT | header)
    assert response.status_code == 400, response.text
    assert on_sweeping.head(url(stream_path)).status_code == 404


def test_a_server_wide_default_applies_to_streams_without_a_policy(
    defaulted: ServerProcess, stream_path: str, database_url: str
) -> None:
    """DS_RETENTION__MAX_BYTES: streams that set no policy get the server's, shown by HEAD;
    a stream's own policy wins; registered state streams and the registry keep everything."""
    with httpx.Client(base_url=defaulted.base_url, timeout=30) as client:
        create(client, stream_path)
        assert head(client, stream_path)["stream-retention-max-bytes"] == "64"
        offsets = append_all(client, stream_path, ["a" * 40, "b" * 40])
        eventually(lambda: moved_past(client, stream_path, offsets[1]), what="default trim")
        assert read_text(client, stream_path)[0] == "b" * 40

        own = f"{stream_path}-own"
        create(client, own, {"Stream-Retention-Max-Age": "86400"})
        own_headers = head(client, own)
        assert own_headers["stream-retention-max-age"] == "86400"
        assert "stream-retention-max-bytes" not in own_headers

        state = f"{stream_path}-state"
        assert client.put(url(state), headers=JSON).status_code == 201
        register_ok(client, state)
        events = [change("user", f"u{i}", {"name": "x" * 30}) for i in range(5)]
        client.post(url(state), headers=JSON, json=events)
        assert "stream-retention-max-bytes" not in head(client, state)
        assert "stream-retention-max-bytes" not in head(client, "__registry__")
        # A sweep with the same default, run to its end, leaves them whole.
        env = command_env(database_url, DS_RETENTION__MAX_BYTES="64")
        args = ["trim_streams", "--stream", state, "--stream", "__registry__"]
        assert manage(database_url, *args, env=env).returncode == 0
        assert start_of(client, state) == "0000000000000000_0000000000000000"
        assert start_of(client, "__registry__") == "0000000000000000_0000000000000000"
        assert len(client.get(url(state), params={"offset": "-1"}).json()) == 5
