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
from pycrdt import Doc, Map

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
