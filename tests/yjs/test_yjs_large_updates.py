"""Large Yjs updates against a worker's other clients (YJS-PROTOCOL.md 5.5; docs/reliability.md).

pycrdt holds Python's global lock for the whole of each call, for a time that grows with the
bytes: integrating one update of a million map entries (about 17 MiB) holds it for seconds.
Checked in a thread of the server, such a POST stopped every other request of the worker for
that long, and a document grown that large did the same each time a process built its copy
(found by measuring: 4.9 s in one call for 54 MB, past uvicorn's 5 s before it kills a worker).
The work is done in a process of its own now (yjs.engine)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from pycrdt import Array, Doc, Map

from tests.yjs.support import OCTET, doc_url, frame, unique

# A gap this long between the answers of a client asking every 50 ms means the worker stopped
# answering; the single calls of the check took two seconds and more before.
STALL_SECS = 1.0


def _many_entries(count: int) -> bytes:
    doc: Doc[Any] = Doc()
    doc["m"] = Map({f"key-{i}": i for i in range(count)})
    return doc.get_update()


def _longest_silence(base_url: str, send: Any) -> tuple[httpx.Response, float]:
    """``send``'s answer, and the longest time without an answer to ``/healthz`` asked every
    50 ms while it ran."""
    answers: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answers.append(send()))
    longest = 0.0
    with httpx.Client(base_url=base_url, timeout=60) as other:
        other.get("/healthz")
        worker.start()
        last = time.monotonic()
        while worker.is_alive():
            assert other.get("/healthz").status_code == 200
            now = time.monotonic()
            longest = max(longest, now - last)
            last = now
            time.sleep(0.05)
    worker.join()
    return answers[0], longest


def test_a_large_update_leaves_the_worker_answering(start_server: Any) -> None:
    """A POST of one update of a million map entries, then a new process's copy of the
    document it made: meanwhile another client is answered without a stall, and the update
    is stored and checked like any other."""
    server = start_server(env={"YJS_CHECK_TIMEOUT_SECS": "60"})
    update = _many_entries(1_000_000)
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        url = doc_url("large", unique("doc"))
        assert client.put(url).status_code == 201
        answer, silence = _longest_silence(
            server.base_url, lambda: client.post(url, content=frame(update), headers=OCTET)
        )
        assert answer.status_code == 204, answer.text
        assert silence < STALL_SECS, f"no answer for {silence:.2f} s"
    # Another process builds its copy of the 17 MiB document to check the next POST.
    second = start_server(env={"YJS_CHECK_TIMEOUT_SECS": "60"})
    edit: Doc[Any] = Doc()
    edit["m"] = Map({"another": 1})
    with httpx.Client(base_url=second.base_url, timeout=120) as client:
        answer, silence = _longest_silence(
            second.base_url,
            lambda: client.post(url, content=frame(edit.get_update()), headers=OCTET),
        )
        assert answer.status_code == 204, answer.text
        assert silence < STALL_SECS, f"no answer for {silence:.2f} s"


def test_an_update_past_the_check_deadline_is_refused(start_server: Any) -> None:
    """Past ``YJS_CHECK_TIMEOUT_SECS`` (and ``YJS_CHECK_SECS_PER_MIB``) the engine's process
    is killed and the POST refused (400), nothing stored; the next POST is checked by a new
    process (started before its deadline begins)."""
    server = start_server(env={"YJS_CHECK_TIMEOUT_SECS": "0.05", "YJS_CHECK_SECS_PER_MIB": "0"})
    update = _many_entries(600_000)
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        url = doc_url("large", unique("doc"))
        assert client.put(url).status_code == 201
        answer = client.post(url, content=frame(update), headers=OCTET)
        assert answer.status_code == 400, answer.text
        assert "could not be checked" in answer.text
        assert client.get(url, params={"offset": "-1"}).content == b""
        small: Doc[Any] = Doc()
        small["m"] = Map({"k": 1})
        assert client.post(url, content=frame(small.get_update()), headers=OCTET).status_code == 204


def _concurrent_inserts(count: int) -> tuple[bytes, list[bytes]]:
    """A document's first update, and ``count`` updates of as many clients each inserting at
    the same place: Yrs' time to build a Doc of them grows faster than their bytes (about
    0.4 s for 3,000, 60 KB; 36 s for 20,000, found by review)."""
    base: Doc[Any] = Doc(client_id=10**9)
    base.get("a", type=Array).append(0)
    first = base.get_update()
    updates = []
    for client in range(1, count + 1):
        doc: Doc[Any] = Doc(client_id=client)
        doc.apply_update(first)
        doc.get("a", type=Array).insert(1, 0)
        updates.append(doc.get_update(base.get_state()))
    return first, updates


def test_a_document_too_costly_to_copy_stays_writable(start_server: Any) -> None:
    """A document whose copy no process can build within the deadline, written 50 updates at
    a time (each cheap against a copy already built). A process that must build its copy (a
    second server here; equally a restart or a refused POST) answered every POST 503 after the
    whole deadline, for good, killing its engine each time (found by review). Now it writes
    such a document's POSTs unchecked, as those of a document that cannot be integrated, and
    says so in its log."""
    env = {
        "YJS_CHECK_TIMEOUT_SECS": "0.2",
        "YJS_CHECK_SECS_PER_MIB": "0",
        "YJS_INLINE_DOCUMENT_BYTES": "0",
    }
    first, updates = _concurrent_inserts(3000)
    server = start_server(env=env)
    url = doc_url("large", unique("doc"))
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        assert client.put(url).status_code == 201
        assert client.post(url, content=frame(first), headers=OCTET).status_code == 204
        for i in range(0, len(updates), 50):
            body = b"".join(frame(update) for update in updates[i : i + 50])
            answer = client.post(url, content=body, headers=OCTET)
            assert answer.status_code == 204, (i, answer.text)
    second = start_server(env=env)
    with httpx.Client(base_url=second.base_url, timeout=120) as client:
        for client_id in (10**9 + 1, 10**9 + 2):
            edit: Doc[Any] = Doc(client_id=client_id)
            edit.get("a", type=Array).append(1)
            answer = client.post(url, content=frame(edit.get_update()), headers=OCTET)
            assert answer.status_code == 204, answer.text
    assert "no copy could be built within" in second.log_path.read_text()
