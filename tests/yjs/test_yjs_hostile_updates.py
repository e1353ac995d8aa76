"""Updates Yrs would decode to harm: refused before pycrdt sees them (yjs.structure).

Found by a probe: one POST of 60 KB, a value of 30,000 nested one-element arrays, overflowed
the stack of the worker decoding it (SIGSEGV: the worker died, and with it the long-polls it
held); the same at 200 KB, checked in the engine's process, killed that process at every try
and answered 503 "retry". And updates with client ids or clocks past 2^53 - 1 were stored:
JavaScript clients read those ids as doubles, so one that read the document from the start and
one that joined from the snapshot (which Yrs writes) saw different text.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.yjs.support import OCTET, doc_url, frame, read_all, tail_of, unique, var_uint

# lib0 value tags (readAny): an array, and null.
ARRAY, NULL = 0x75, 0x7E
# Content kinds of a struct's info byte: a string, lib0 values; 0x20: a key in a map follows.
STRING, ANY, KEYED = 4, 8, 0x20


def _string(text: str) -> bytes:
    data = text.encode()
    return var_uint(len(data)) + data


def _update(client: int, clock: int, info: int, content: bytes, key: str | None = None) -> bytes:
    """One struct of ``client`` at ``clock`` in the root type "t" (no origins: its parent and,
    for a map, its key written out), and an empty delete set."""
    parent = var_uint(1) + _string("t") + (_string(key) if key is not None else b"")
    struct = bytes([info]) + parent + content
    return var_uint(1) + var_uint(1) + var_uint(client) + var_uint(clock) + struct + var_uint(0)


def _nested(depth: int) -> bytes:
    """A map entry holding one value: ``depth`` one-element arrays around a null."""
    return _update(7, 0, ANY | KEYED, var_uint(1) + bytes([ARRAY, 1]) * depth + bytes([NULL]), "k")


def _text(client: int, clock: int) -> bytes:
    return _update(client, clock, STRING, _string("X"))


@pytest.fixture(scope="module")
def server(start_server: Any) -> ServerProcess:
    """Its own server: before the fix, the first test killed its only process."""
    return start_server(env={"DS_SERVER__LONG_POLL_TIMEOUT_SECS": "3"})  # type: ignore[no-any-return]


def _new_doc(client: httpx.Client, server: ServerProcess) -> str:
    url = server.base_url + doc_url("hostile", unique("doc"))
    assert client.put(url).status_code == 201
    return url


@pytest.mark.parametrize(
    ("depth", "where"), [(30_000, "in the worker"), (100_000, "in the engine's process")]
)
def test_values_nested_past_what_yrs_decodes_are_refused_and_hurt_nobody(
    server: ServerProcess, depth: int, where: str
) -> None:
    """The update is a 400 and changes nothing, and a long-poll another client holds on another
    document meanwhile ends as long-polls do (204), not cut with its worker."""
    with httpx.Client(timeout=30) as client:
        url, other = _new_doc(client, server), _new_doc(client, server)
        tail = tail_of(client, url)
        polled: list[httpx.Response | Exception] = []

        def poll() -> None:
            try:
                with httpx.Client(timeout=30) as own:
                    offset = tail_of(own, other)
                    polled.append(own.get(other, params={"offset": offset, "live": "long-poll"}))
            except httpx.HTTPError as exc:
                polled.append(exc)

        poller = threading.Thread(target=poll)
        poller.start()
        body = frame(_nested(depth))
        answer = client.post(url, content=body, headers=OCTET)
        poller.join()
        assert answer.status_code == 400, (where, answer.status_code, answer.text[:200])
        assert "nests deeper than" in answer.text
        assert tail_of(client, url) == tail
        assert isinstance(polled[0], httpx.Response), polled
        assert polled[0].status_code == 204


def test_a_value_nested_a_thousand_deep_may_be_stored(server: ServerProcess) -> None:
    with httpx.Client(timeout=30) as client:
        url = _new_doc(client, server)
        answer = client.post(url, content=frame(_nested(1000)), headers=OCTET)
        assert answer.status_code == 204, answer.text
        data, _ = read_all(client, url)
        assert data == frame(_nested(1000))


@pytest.mark.parametrize(
    ("client_id", "clock"),
    [(2**53, 0), (2**64 - 1, 0), (2**64, 0), (1, 2**53), (1, 2**53 - 1), (1, 2**64)],
    ids=["id 2^53", "id 2^64-1", "id 2^64", "clock 2^53", "clock ending past 2^53-1", "clock 2^64"],
)
def test_ids_and_clocks_past_what_javascript_reads_exactly_are_refused(
    server: ServerProcess, client_id: int, clock: int
) -> None:
    with httpx.Client(timeout=30) as client:
        url = _new_doc(client, server)
        tail = tail_of(client, url)
        answer = client.post(url, content=frame(_text(client_id, clock)), headers=OCTET)
        assert answer.status_code == 400, answer.text
        assert "2^53" in answer.text
        assert tail_of(client, url) == tail


def test_the_largest_id_javascript_reads_exactly_is_stored(server: ServerProcess) -> None:
    with httpx.Client(timeout=30) as client:
        url = _new_doc(client, server)
        answer = client.post(url, content=frame(_text(2**53 - 1, 0)), headers=OCTET)
        assert answer.status_code == 204, answer.text
