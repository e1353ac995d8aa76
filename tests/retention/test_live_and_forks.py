"""Live readers and forks across trims, through real HTTP (PROTOCOL.md 4.2 forks, 5.7
long-poll, 5.8 SSE; docs/gaps.md, Retention: a fork never loses what it reads through its
source)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.retention.support import (
    BEGINNING,
    TEXT,
    append_all,
    create,
    eventually,
    head,
    read_text,
    sse_events,
    start_of,
    stored_seqs,
    trim,
    url,
)

MESSAGES = [f"m{i};" for i in range(10)]


def test_a_live_sse_reader_at_the_tail_goes_on_across_a_trim(
    client: httpx.Client, server: ServerProcess, stream_path: str
) -> None:
    """An SSE reader that has caught up keeps receiving appends after everything before it is
    trimmed: its offset is the stream's tail, still retained."""
    create(client, stream_path)
    offsets = append_all(client, stream_path, MESSAGES[:3])
    after: list[str] = []

    def writer() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as other:
            assert trim(other, stream_path, "now").status_code == 204
            after.extend(append_all(other, stream_path, ["late-1;", "late-2;"])[1:])

    def done(events: list[tuple[str, str]]) -> bool:
        return "late-2;" in "".join(d for _, d in events) and events[-1][0] == "control"

    started = False
    for events in sse_events(client, stream_path, "-1", until=done):
        if not started and events[-1][0] == "control":
            started = True  # caught up (the first data and its control event): now trim
            thread = threading.Thread(target=writer)
            thread.start()
    thread.join()
    data = "".join(d for kind, d in events if kind == "data")
    assert data == "".join(MESSAGES[:3]) + "late-1;late-2;"
    controls = [json.loads(d)["streamNextOffset"] for kind, d in events if kind == "control"]
    assert controls[0] == offsets[-1] and controls[-1] == after[-1]
    assert start_of(client, stream_path) == offsets[-1]


def test_a_long_poll_at_the_tail_is_answered_across_a_trim(
    client: httpx.Client, server: ServerProcess, stream_path: str
) -> None:
    """A long-poll waiting at the tail answers the first append after a trim of everything."""
    create(client, stream_path)
    tail = append_all(client, stream_path, MESSAGES[:2])[-1]
    answers: list[httpx.Response] = []

    def poll() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as other:
            params = {"offset": tail, "live": "long-poll"}
            answers.append(other.get(url(stream_path), params=params))

    thread = threading.Thread(target=poll)
    thread.start()
    assert trim(client, stream_path, "now").status_code == 204
    appended = append_all(client, stream_path, ["new;"])
    thread.join()
    (answer,) = answers
    if answer.status_code == 204:  # the server's 2 s long-poll timeout came first: poll again
        answer = client.get(url(stream_path), params={"offset": tail, "live": "long-poll"})
    assert answer.status_code == 200 and answer.text == "new;"
    assert answer.headers["Stream-Next-Offset"] == appended[-1]


def test_a_catch_up_reader_behind_a_trim_is_told_where_to_restart(
    client: httpx.Client, stream_path: str
) -> None:
    """A reader resuming from an offset that was trimmed meanwhile gets 410 with the start,
    and reading from there gives exactly what is retained."""
    create(client, stream_path)
    offsets = append_all(client, stream_path, MESSAGES)
    first = client.get(url(stream_path), params={"offset": offsets[2]})
    assert first.status_code == 200
    assert trim(client, stream_path, offsets[6]).status_code == 204
    again = client.get(url(stream_path), params={"offset": offsets[2]})
    assert again.status_code == 410
    restart = again.headers["Stream-Start-Offset"]
    assert read_text(client, stream_path, restart) == ("".join(MESSAGES[6:]), offsets[-1])


@pytest.fixture(scope="module")
def one_message_chunks(start_server: Any) -> Iterator[ServerProcess]:
    """Catch-up reads (and SSE data events) of at most one 64 KiB message each."""
    server = start_server(env={"DS_READ__MAX_CHUNK_BYTES": "65536"})
    yield server
    server.stop()


def test_an_sse_reader_catching_up_behind_a_trim_ends_and_gets_410(
    one_message_chunks: ServerProcess, stream_path: str
) -> None:
    """An SSE reader still catching up when its next messages are trimmed: its response ends
    (without streamClosed; PROTOCOL.md 5.8 has no error event), and reconnecting from its last
    offset answers 410 with the start. The reader stops reading after its first event, so the
    server is held (TCP flow control) far before the trim point."""
    message = "x" * 65536
    with httpx.Client(base_url=one_message_chunks.base_url, timeout=60) as client:
        create(client, stream_path)
        offsets = append_all(client, stream_path, [message] * 400)  # 25 MiB, kernel buffers less
        seen: list[tuple[str, str]] = []
        for events in sse_events(client, stream_path, "-1", until=lambda e: False):
            if len(events) == 2:
                assert trim(client, stream_path, offsets[390]).status_code == 204
            seen = events
        controls = [json.loads(d) for kind, d in seen if kind == "control"]
        last = controls[-1]["streamNextOffset"]
        assert last < offsets[390] and not controls[-1].get("streamClosed")
        # Every event continued where the one before ended.
        assert [c["streamNextOffset"] for c in controls] == offsets[1 : len(controls) + 1]
        again = client.get(url(stream_path), params={"offset": last, "live": "sse"})
        assert again.status_code == 410
        assert again.headers["Stream-Start-Offset"] == offsets[390]


@pytest.fixture
def forked(client: httpx.Client, stream_path: str) -> tuple[str, str, list[str]]:
    """A source of ten messages and a fork of it at the sixth (with one message of its own):
    (source path, fork path, the source's offsets)."""
    create(client, stream_path)
    offsets = append_all(client, stream_path, MESSAGES)
    fork = f"{stream_path}-fork"
    headers = {"Stream-Forked-From": url(stream_path), "Stream-Fork-Offset": offsets[6]}
    assert client.put(url(fork), headers=headers).status_code == 201
    client.post(url(fork), headers=TEXT, content="own;")
    return stream_path, fork, offsets


def test_trimming_a_source_never_takes_what_its_fork_reads(
    client: httpx.Client, forked: tuple[str, str, list[str]], pg: Any
) -> None:
    """Trimming a source trims it for its own readers only: its fork still reads the messages
    it inherited, and those rows are kept while the fork needs them; the source's rows no
    fork needs are purged, the rest once the fork is deleted."""
    source, fork, offsets = forked
    assert trim(client, source, offsets[8]).status_code == 204
    assert read_text(client, source)[0] == "".join(MESSAGES[8:])
    assert read_text(client, fork)[0] == "".join(MESSAGES[:6]) + "own;"
    assert start_of(client, fork) == BEGINNING
    # Rows 6 and 7 are read by nobody now; 0-5 are the fork's.
    eventually(lambda: stored_seqs(pg, source) == [0, 1, 2, 3, 4, 5, 8, 9] or None, what="purge")
    assert client.delete(url(fork)).status_code == 204
    assert read_text(client, source)[0] == "".join(MESSAGES[8:])
    eventually(lambda: stored_seqs(pg, source) == [8, 9] or None, what="purge after the fork")


def test_a_soft_deleted_source_keeps_only_what_its_fork_reads(
    client: httpx.Client, forked: tuple[str, str, list[str]], pg: Any
) -> None:
    """PROTOCOL.md 4.2: a source deleted while a fork reads through it is soft-deleted (410)
    and keeps its data for the fork: only what the fork reads; the rest is purged."""
    source, fork, _ = forked
    assert client.delete(url(source)).status_code == 204
    assert client.get(url(source), params={"offset": "-1"}).status_code == 410
    eventually(lambda: stored_seqs(pg, source) == [0, 1, 2, 3, 4, 5] or None, what="purge")
    assert read_text(client, fork)[0] == "".join(MESSAGES[:6]) + "own;"


def test_trimming_a_fork_into_what_it_inherited(
    client: httpx.Client, forked: tuple[str, str, list[str]], pg: Any
) -> None:
    """A fork trims its inherited messages like its own: it starts there, the source still
    reads everything, and the source's rows nobody reads any more are purged."""
    source, fork, offsets = forked
    assert trim(client, source, offsets[8]).status_code == 204
    assert trim(client, fork, offsets[3]).status_code == 204
    assert read_text(client, fork)[0] == "".join(MESSAGES[3:6]) + "own;"
    assert client.get(url(fork), params={"offset": offsets[1]}).status_code == 410
    assert read_text(client, source)[0] == "".join(MESSAGES[8:])
    eventually(lambda: stored_seqs(pg, source) == [3, 4, 5, 8, 9] or None, what="purge")


def test_forks_of_a_trimmed_source_start_where_it_does(
    client: httpx.Client, forked: tuple[str, str, list[str]]
) -> None:
    """A fork offset before the source's start is gone (410 with the start); a fork of the
    trimmed source starts where the source does, and inherits its retention policy."""
    source, _, offsets = forked
    assert trim(client, source, offsets[4]).status_code == 204
    early = {"Stream-Forked-From": url(source), "Stream-Fork-Offset": offsets[2]}
    refused = client.put(url(f"{source}-early"), headers=early)
    assert refused.status_code == 410
    assert refused.headers["Stream-Start-Offset"] == offsets[4]
    assert client.head(url(f"{source}-early")).status_code == 404

    policy = f"{source}-policy"
    create(client, policy, {"Stream-Retention-Max-Age": "86400"})
    append_all(client, policy, MESSAGES[:2])
    inherits = client.put(url(f"{policy}-fork"), headers={"Stream-Forked-From": url(policy)})
    assert inherits.status_code == 201
    assert head(client, f"{policy}-fork")["stream-retention-max-age"] == "86400"

    late = client.put(url(f"{source}-late"), headers={"Stream-Forked-From": url(source)})
    assert late.status_code == 201
    assert start_of(client, f"{source}-late") == offsets[4]
    assert read_text(client, f"{source}-late")[0] == "".join(MESSAGES[4:])


def test_a_held_sse_reader_is_not_sent_what_a_trim_removed(
    server: ServerProcess, stream_path: str
) -> None:
    """An SSE reader whose client stops reading while an 8 MiB message is sent to it; 20
    small appends follow, kept in the process's memory for live readers; the stream is
    trimmed to its tail. When the client reads again it got the 20 small messages from that
    memory, though a catch-up read of them already answered 410 (probe 8a). Its response now
    ends after the large message, and reconnecting answers 410."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        create(client, stream_path)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(
            f"GET {url(stream_path)}?offset=now&live=sse HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        received = b""
        while b"upToDate" not in received:
            received += sock.recv(65536)
        large_end = append_all(client, stream_path, ["L" * (8 << 20)])[-1]
        time.sleep(1)  # the reader's send of the large event is held by the client
        append_all(client, stream_path, [f"S{n:02};" for n in range(20)])
        assert trim(client, stream_path, "now").status_code == 204
        assert client.get(url(stream_path), params={"offset": large_end}).status_code == 410
        time.sleep(0.5)  # the trim's notification is heard
        sock.settimeout(20)
        while chunk := sock.recv(1 << 20):
            received += chunk
        sock.close()
        assert received.count(b"L" * 1000) > 0  # the large message was delivered
        assert b"S00;" not in received and b"S19;" not in received
        again = client.get(url(stream_path), params={"offset": large_end, "live": "sse"})
        assert again.status_code == 410
