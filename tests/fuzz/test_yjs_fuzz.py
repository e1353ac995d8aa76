"""Stateful fuzzing of ``/v1/yjs/<service>/docs/<path>`` (YJS-PROTOCOL.md).

Updates are real Yjs updates made with pycrdt by a local replica of each document, and garbage
made from them: random bytes, truncated and mutated lib0 frames and Yjs updates, frames whose
length prefix lies, empty bodies, closes. Documents are compacted at 4 KiB on the fuzz server
(tests/fuzz/conftest.py), so snapshots are made and replaced while the fuzzer runs.

Invariants, besides no 5xx and no hang: a refused update leaves the document's updates
unchanged; an accepted one appends exactly its body; and whenever only well-formed updates were
accepted, the document a client rebuilds from the server (snapshot discovery, the snapshot,
then the updates after it) has the same text as the local replica.
"""

from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)
from pycrdt import Doc, Text

from tests.fuzz import strategies as s
from tests.fuzz.support import TALLY, RawHttp, Reply, describe, examples, fuzz_settings

SERVICE = "fuzz"
OCTET = [(b"Content-Type", b"application/octet-stream")]
Header = tuple[bytes, bytes]
# Rebuilds that started from a snapshot (not offset=-1): the compaction path was exercised.
SNAPSHOTS_READ = [0]


def var_uint(value: int) -> bytes:
    """lib0 writeVarUint (YJS-PROTOCOL.md 7.1), written here from the spec."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def frame(update: bytes) -> bytes:
    return var_uint(len(update)) + update


def unframe(data: bytes) -> list[bytes]:
    updates, index = [], 0
    while index < len(data):
        length, shift = 0, 0
        while True:
            byte = data[index]
            index += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        updates.append(data[index : index + length])
        index += length
    return updates


@dataclass
class DocModel:
    exists: bool = False
    content: bytes = b""  # every accepted body, in order: what GET offset=-1 returns
    tail: str | None = None
    updates: list[bytes] = field(default_factory=list)  # accepted well-formed updates
    only_valid: bool = True  # no accepted update came from the garbage generators

    def replica(self) -> Doc:
        doc = Doc()
        for update in self.updates:
            doc.apply_update(update)
        return doc


class YjsFuzz(RuleBasedStateMachine):
    port: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.http = RawHttp(self.port)
        run = uuid.uuid4().hex[:12]
        self.docs = {name: DocModel() for name in (f"{run}/d1", f"{run}/dir/d-2", f"{run}.x")}
        self.client_id = 4242  # fixed: update sizes, and so the draws, must not vary by run
        self.broken = False

    def teardown(self) -> None:
        try:
            if sys.exc_info()[0] is None and not self.broken:
                for name in self.docs:
                    self.verify(name, "the final re-read")
                    self.verify_rebuild(name)
        finally:
            self.http.close()

    def url(self, name: str, query: str = "") -> str:
        return f"/v1/yjs/{SERVICE}/docs/{name}" + (f"?{query}" if query else "")

    def fail(self, message: str) -> None:
        self.broken = True
        TALLY.partial_writes.append(message)
        raise AssertionError(message)

    # -- re-reading -----------------------------------------------------------------------------

    def read(self, name: str) -> tuple[bool, str | None, bytes]:
        head = self.http.send("HEAD", self.url(name), check=True)
        if head.status == 404:
            return False, None, b""
        assert head.status == 200, head.status
        content, offset = b"", "-1"
        for _ in range(64):
            page = self.http.send("GET", self.url(name, f"offset={offset}"), check=True)
            assert page.status == 200, (page.status, page.body[:200])
            content += page.body
            if page.header("Stream-Up-To-Date") == "true":
                break
            offset = page.header("Stream-Next-Offset") or ""
        return True, head.header("Stream-Next-Offset"), content

    def verify(self, name: str, why: str) -> None:
        model = self.docs[name]
        seen = self.read(name)
        if seen != (model.exists, model.tail, model.content):
            self.fail(
                f"document {name!r} changed after {why}: expected exists={model.exists} "
                f"tail={model.tail} {len(model.content)} bytes, read exists={seen[0]} "
                f"tail={seen[1]} {len(seen[2])} bytes; last request: {self.last}"
            )

    def verify_rebuild(self, name: str) -> None:
        """A client's initial sync (YJS-PROTOCOL.md 5.2, 5.3) rebuilds the replica's text."""
        model = self.docs[name]
        if not model.exists or not model.only_valid:
            return
        for _ in range(3):  # a compaction may replace the snapshot between two requests
            found = self.http.send("GET", self.url(name, "offset=snapshot"), check=True)
            assert found.status == 307, (found.status, found.body[:200])
            location = found.header("Location") or ""
            query = urlsplit(location).query
            assert urlsplit(location).path == self.url(name), location
            doc = Doc()
            offset = query.removeprefix("offset=")
            if offset != "-1":
                SNAPSHOTS_READ[0] += 1
                snap = self.http.send("GET", self.url(name, query), check=True)
                if snap.status == 404:
                    continue
                assert snap.status == 200, (snap.status, snap.body[:200])
                doc.apply_update(snap.body)
                offset = snap.header("Stream-Next-Offset") or ""
            for _ in range(64):
                page = self.http.send("GET", self.url(name, f"offset={offset}"), check=True)
                assert page.status == 200, (page.status, page.body[:200])
                for update in unframe(page.body):
                    doc.apply_update(update)
                if page.header("Stream-Up-To-Date") == "true":
                    break
                offset = page.header("Stream-Next-Offset") or ""
            expected = str(model.replica().get("t", type=Text))
            rebuilt = str(doc.get("t", type=Text))
            if rebuilt != expected:
                self.fail(
                    f"document {name!r} rebuilt from snapshot {query!r} reads {rebuilt[:200]!r}, "
                    f"the replica {expected[:200]!r}"
                )
            return
        raise AssertionError(f"no snapshot of {name!r} could be read three times in a row")

    # -- sending --------------------------------------------------------------------------------

    def send(
        self, method: str, target: str, headers: list[Header], body: bytes | None, **kw: Any
    ) -> Reply:
        self.last = describe(method.encode(), target.encode(), headers, body)
        return self.http.send(method, target, headers, body, **kw)

    def valid_update(self, data: st.DataObject, model: DocModel) -> bytes:
        """An edit of the replica (insert or delete in the text), as a Yjs update."""
        local = Doc(client_id=self.client_id)
        for update in model.updates:
            local.apply_update(update)
        text = local.get("t", type=Text)
        before = local.get_state()
        length = len(str(text))
        # Every draw is made whatever the replica holds (Hypothesis replays draws).
        delete = data.draw(st.integers(0, 3), label="delete?") == 0 and length > 0
        start = s.between(data, 0, max(length - 1, 0), label="start")
        size = data.draw(st.integers(1, 20), label="size")
        at = s.between(data, 0, length, label="at")
        chars = st.characters(exclude_categories=["Cs"])
        inserted = data.draw(st.text(chars, min_size=1, max_size=300), label="text")
        content = str(text)

        def unit(index: int) -> int:  # pycrdt counts positions in UTF-8 bytes
            return len(content[:index].encode("utf-8"))

        if delete:
            del text[unit(start) : unit(min(length, start + size))]
        else:
            text.insert(unit(at), inserted)
        return local.get_update(before)

    def post(self, name: str, body: bytes, headers: list[Header], updates: list[bytes]) -> None:
        """POST a body; ``updates`` are the well-formed updates it carries (empty: garbage)."""
        model = self.docs[name]
        reply = self.send("POST", self.url(name), headers, body)
        if reply.status == 204:
            if not model.exists:
                self.fail(f"an update to a missing document was accepted: {self.last}")
            model.content += body
            if updates:
                model.updates += updates
            else:
                model.only_valid = False
            seen = self.read(name)
            if seen[2] != model.content:
                self.fail(f"an accepted update of {name!r} was not stored as sent: {self.last}")
            model.tail = seen[1]
        else:
            if updates and model.exists and reply.status not in (0, 400, 409, 413):
                self.fail(f"a well-formed update was refused with {reply.status}: {self.last}")
            self.verify(name, f"a refused update ({reply.status})")

    # -- rules ----------------------------------------------------------------------------------

    def doc(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.docs)), label="document")

    @initialize()
    def create_documents(self) -> None:
        """Every run starts with its documents created (rules delete and re-create them)."""
        for name, model in self.docs.items():
            reply = self.send("PUT", self.url(name), [], None)
            assert reply.status == 201, (reply.status, reply.body)
            model.exists = True
            model.tail = self.read(name)[1]
        # One document starts past the compaction threshold, so every run has a snapshot to
        # rebuild from whatever the draws (a run of small edits may never reach it).
        name = sorted(self.docs)[0]
        local = Doc(client_id=self.client_id)
        local["t"] = Text("seed " * 200)
        update = local.get_update()
        self.post(name, frame(update), OCTET, [update])

    @rule(data=st.data())
    def create(self, data: st.DataObject) -> None:
        name = self.doc(data)
        headers = data.draw(s.header_set({b"Content-Type": s.content_type}), label="headers")
        reply = self.send("PUT", self.url(name), headers, data.draw(st.sampled_from([None, b""])))
        model = self.docs[name]
        if reply.status == 201:
            assert not model.exists, f"201 for an existing document: {self.last}"
            model.exists = True
            model.content, model.updates, model.only_valid = b"", [], True
            model.tail = self.read(name)[1]
        elif reply.status == 200:
            assert model.exists, f"200 for a missing document: {self.last}"
        self.verify(name, f"PUT ({reply.status})")

    @rule(data=st.data())
    def post_updates(self, data: st.DataObject) -> None:
        self._post_updates(data)

    @rule(data=st.data())
    def post_more_updates(self, data: st.DataObject) -> None:
        """Well-formed updates get twice the weight: documents grow past the compaction
        threshold and get snapshots."""
        self._post_updates(data)

    def _post_updates(self, data: st.DataObject) -> None:
        name = self.doc(data)
        model = self.docs[name]
        count = data.draw(st.integers(1, 3), label="updates")
        updates = []
        for _ in range(count):
            updates.append(self.valid_update(data, model))
            if model.exists:  # later edits build on earlier ones of the same body
                model.updates.append(updates[-1])
        if model.exists:
            del model.updates[-count:]
        self.post(name, b"".join(frame(u) for u in updates), OCTET, updates)

    @rule(data=st.data())
    def post_garbage(self, data: st.DataObject) -> None:
        name = self.doc(data)
        valid = frame(self.valid_update(data, self.docs[name]))
        kind = data.draw(
            st.sampled_from(
                ["random", "truncated", "flipped", "lying length", "raw update", "frame of junk",
                 "empty", "huge", "extra byte", "close", "wrong type", "no type"]
            ),
            label="garbage",
        )  # fmt: skip
        headers = list(OCTET)
        if kind == "random":
            body = data.draw(st.binary(min_size=1, max_size=300))
        elif kind == "truncated":
            body = valid[: s.between(data, 0, len(valid) - 1)]
        elif kind == "flipped":
            at = s.between(data, 1, len(valid) - 1)
            body = (
                valid[:at] + bytes([valid[at] ^ data.draw(st.integers(1, 255))]) + valid[at + 1 :]
            )
        elif kind == "lying length":
            body = var_uint(data.draw(st.sampled_from([2**49, 2**56, 10**6]))) + valid[1:]
        elif kind == "raw update":
            body = valid[1:]  # an update without its frame
        elif kind == "frame of junk":
            body = frame(data.draw(st.binary(min_size=0, max_size=100)))
        elif kind == "empty":
            body = b""
        elif kind == "huge":
            body = frame(b"\x00" * (130 * 1024))
        elif kind == "extra byte":
            body = valid + b"\x05"
        elif kind == "close":
            body, headers = valid, [*OCTET, (b"Stream-Closed", b"true")]
        elif kind == "wrong type":
            body, headers = valid, [(b"Content-Type", data.draw(s.content_type))]
        else:
            body, headers = valid, []
        # A mutated update may still be well formed (the server only checks it decodes):
        # whatever it is, once accepted the replica can no longer be compared.
        self.post(name, body, headers, [])

    @rule(data=st.data())
    def read_doc(self, data: st.DataObject) -> None:
        name = self.doc(data)
        model = self.docs[name]
        offsets = ["-1", "now", "snapshot", "x_snapshot", "-1_snapshot", "", "junk"]
        if model.tail:
            offsets += [model.tail, model.tail + "_snapshot"]
        offset = s.pick(data, offsets, label="offset")
        live = data.draw(st.sampled_from(["", "&live=long-poll", "&live=sse"]), label="live")
        reply = self.send(
            "GET", self.url(name, f"offset={offset}{live}"), [], None, sse="sse" in live
        )
        if offset == "snapshot" and model.exists:
            assert reply.status == 307, (reply.status, self.last)
        self.verify(name, f"GET ({reply.status})")

    @rule(data=st.data())
    def rebuild(self, data: st.DataObject) -> None:
        self.verify_rebuild(self.doc(data))

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = self.doc(data)
        reply = self.send("DELETE", self.url(name), [], None)
        model = self.docs[name]
        if reply.status == 204:
            assert model.exists, f"204 for deleting a missing document: {self.last}"
            self.docs[name] = DocModel()
        else:
            assert not model.exists or reply.status == 0, (reply.status, self.last)
        self.verify(name, f"DELETE ({reply.status})")

    @rule(data=st.data())
    def awareness(self, data: st.DataObject) -> None:
        name = self.doc(data)
        who = data.draw(st.sampled_from(["default", "admin", "", "a b", "x" * 65, "%2e%2e"]))
        method = data.draw(st.sampled_from(["PUT", "POST", "GET", "HEAD", "DELETE", "PATCH"]))
        query = f"awareness={who}"
        body = None
        sse = False
        if method == "POST":
            body = data.draw(
                st.one_of(st.binary(max_size=50).map(frame), st.binary(max_size=50), st.just(b""))
            )
        if method == "GET":
            query += data.draw(st.sampled_from(["", "&offset=-1", "&offset=now&live=sse"]))
            sse = "sse" in query
        self.send(method, self.url(name, query), list(OCTET), body, sse=sse)
        self.verify(name, f"an awareness {method}")

    @rule(data=st.data())
    def odd_request(self, data: st.DataObject) -> None:
        """Other methods, bad services and document paths, junk queries."""
        name = self.doc(data)
        target = data.draw(
            st.sampled_from(
                [self.url(name), f"/v1/yjs/{SERVICE}/docs/{name}/..", f"/v1/yjs/{SERVICE}/docs/",
                 f"/v1/yjs/{SERVICE}/docs/%2e%2e", f"/v1/yjs/{SERVICE}/docs/a%00b",
                 f"/v1/yjs/{SERVICE}/docs/\u00e9", "/v1/yjs/bad service/docs/x",
                 "/v1/yjs/" + "s" * 65 + "/docs/x", f"/v1/yjs/{SERVICE}/doc/x", "/v1/yjs/",
                 f"/v1/yjs/{SERVICE}/docs/" + "d" * 600, self.url(name, "awareness=a&awareness=b"),
                 self.url(name, "offset=-1&offset=now"), self.url(name, "%ff=%fe")]
            ),
            label="target",
        )  # fmt: skip
        method = data.draw(st.sampled_from(["GET", "PUT", "POST", "OPTIONS", "PATCH", "TRACE"]))
        if target.startswith(self.url(name)) and "awareness" not in target:
            # The document's own URL with a junk query: only methods that change nothing.
            method = {"PUT": "HEAD", "POST": "GET"}.get(method, method)
        headers = data.draw(s.header_set({b"Content-Type": s.content_type}), label="headers")
        body = data.draw(st.sampled_from([None, b"", frame(b"\x00\x00")]))
        if method in ("GET", "HEAD"):
            body = None
        self.send(method, target, headers, body)
        self.verify(name, f"{method} {target[:60]}")


def test_yjs_fuzz(fuzz_server: Any) -> None:
    """The state machine above: ``FUZZ_SCALE`` x 8 runs of 30 steps each."""
    YjsFuzz.port = fuzz_server.port
    run_state_machine_as_test(
        YjsFuzz, settings=fuzz_settings(max_examples=examples(8), stateful_step_count=40)
    )
    assert SNAPSHOTS_READ[0] > 0, "no document was ever compacted: the snapshot path went untested"
