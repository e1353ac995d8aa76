"""Helpers for the Yjs endpoint tests (YJS-PROTOCOL.md).

lib0 framing is written here from the spec (7.1, 7.2), not imported from the server, so the
tests check the server against the spec rather than against itself. Updates are real Yjs
updates made by pycrdt; the SSE parser follows PROTOCOL.md 5.8 (base64 data events).
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx
import psycopg
from pycrdt import Doc, Text

OCTET = {"Content-Type": "application/octet-stream"}
TEXT_NAME = "content"
_counter = itertools.count()
T = TypeVar("T")


# -- lib0 framing (YJS-PROTOCOL.md 7) ----------------------------------------------------------

# Bytes of updates since the last snapshot that trigger a compaction in the tests' compacting
# servers, lowered from the default 1 MiB as YJS-PROTOCOL.md 8.1 allows.
COMPACTION_THRESHOLD = 1500


def var_uint(value: int) -> bytes:
    """lib0 writeVarUint: 7 bits per byte, high bit set while more bytes follow (7.1)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def frame(update: bytes) -> bytes:
    """lib0 writeVarUint8Array: length prefix, then the bytes (7.2)."""
    return var_uint(len(update)) + update


def frames(*updates: bytes) -> bytes:
    return b"".join(frame(update) for update in updates)


def read_frames(data: bytes) -> list[bytes]:
    """lib0 readVarUint8Array until the bytes run out (7.3); ValueError on a broken frame."""
    updates: list[bytes] = []
    index = 0
    while index < len(data):
        length = shift = 0
        while True:
            if index >= len(data):
                raise ValueError("truncated length prefix")
            byte = data[index]
            index += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        if index + length > len(data):
            raise ValueError("frame runs past the end")
        updates.append(data[index : index + length])
        index += length
    return updates


# -- Yjs documents -------------------------------------------------------------------------------


class Writer:
    """A client's Y.Doc with one Y.Text; each edit yields the update it produced."""

    def __init__(self, client_id: int | None = None) -> None:
        self.doc: Doc = Doc(client_id=client_id)
        self.text = self.doc.get(TEXT_NAME, type=Text)
        self.updates: list[bytes] = []
        self.doc.observe(lambda event: self.updates.append(event.update))

    def edit(self, chars: str) -> bytes:
        """Append ``chars`` at the end of the text; the update of that one transaction."""
        before = len(self.updates)
        self.text += chars
        assert len(self.updates) == before + 1
        return self.updates[-1]

    @property
    def content(self) -> str:
        return str(self.text)


def content_of(*updates: bytes) -> str:
    """The text of a fresh Y.Doc after applying ``updates`` in order."""
    doc: Doc = Doc()
    for update in updates:
        doc.apply_update(update)
    return str(doc.get(TEXT_NAME, type=Text))


# -- URLs, requests, answers ---------------------------------------------------------------------


def unique(prefix: str) -> str:
    """A name no other test (or run) uses: letters, digits and '-' only."""
    clean = re.sub(r"[^A-Za-z0-9-]+", "-", prefix).strip("-")[:40]
    return f"{clean}-{time.time_ns()}-{next(_counter)}"


def doc_url(service: str, path: str) -> str:
    return f"/v1/yjs/{service}/docs/{path}"


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> str:
    """The spec's error answer (YJS-PROTOCOL.md 10): the status, and a JSON body
    ``{"error": {"code", "message"}}``; returns the code."""
    assert response.status_code == status, (response.status_code, response.text)
    if response.request.method == "HEAD":
        return ""
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"]["code"], str) and body["error"]["code"], body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]["code"]


def tail_of(client: httpx.Client, url: str, **params: str) -> str:
    response = client.head(url, params=params)
    assert response.status_code == 200, response.status_code
    return response.headers["Stream-Next-Offset"]


def post_ok(client: httpx.Client, url: str, body: bytes, **params: str) -> str:
    """POST lib0-framed bytes; 204 with the new tail (5.5), which is returned."""
    response = client.post(url, params=params, headers=OCTET, content=body)
    assert response.status_code == 204, (response.status_code, response.text)
    return response.headers["Stream-Next-Offset"]


def read_all(
    client: httpx.Client, url: str, offset: str = "-1", **params: str
) -> tuple[bytes, str]:
    """Catch-up reads from ``offset`` until Stream-Up-To-Date: (the bytes, the next offset)."""
    chunks: list[bytes] = []
    for _ in range(1000):
        response = client.get(url, params={"offset": offset, **params})
        assert response.status_code == 200, (response.status_code, response.text)
        chunks.append(response.content)
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            return b"".join(chunks), offset
    raise AssertionError("never up to date")


def location_offset(response: httpx.Response, url: str) -> str:
    """The ``offset`` a snapshot-discovery redirect points at, after checking that it points
    at the same document URL (YJS-PROTOCOL.md 5.2)."""
    assert response.status_code == 307, (response.status_code, response.text)
    target = urlsplit(urljoin(str(response.request.url), response.headers["Location"]))
    assert target.path == url, (target.path, url)
    query = parse_qs(target.query, keep_blank_values=True)
    assert list(query) == ["offset"], query
    (offset,) = query["offset"]
    return offset


def offset_after_snapshot(token: str) -> str:
    """The client rule of YJS-PROTOCOL.md 5.3 / 9.2: the snapshot token's offset with its last
    numeric part plus one, zero-padded to the same width (``4782_snapshot`` -> ``4783``)."""
    offset = token.removesuffix("_snapshot")
    assert offset != token, token
    head, last = re.fullmatch(r"(.*?)(\d+)", offset).groups()  # type: ignore[union-attr]
    return f"{head}{int(last) + 1:0{len(last)}d}"


def wait_for(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll ``probe`` until it returns something other than None, for at most ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def raw_request(
    port: int, method: str, target: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A request with the target sent exactly as given (httpx would resolve dot segments)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", "0")
        conn.endheaders()
        response = conn.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        conn.close()


# -- SSE (PROTOCOL.md 5.8) -----------------------------------------------------------------------


@dataclass
class SseEvent:
    kind: str
    data: str

    @property
    def control(self) -> dict[str, Any]:
        assert self.kind == "control", self
        return json.loads(self.data)

    @property
    def payload(self) -> bytes:
        """A base64 data event's bytes: data lines joined, line breaks removed, decoded."""
        assert self.kind == "data", self
        text = self.data.replace("\n", "").replace("\r", "")
        assert len(text) % 4 == 0, text
        return base64.b64decode(text, validate=True)


def sse_events(lines: Iterator[str]) -> Iterator[SseEvent]:
    """Events of an SSE body, given its lines (comments skipped)."""
    kind = "message"
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield SseEvent(kind, "\n".join(data))
            kind, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                kind = value
            elif name == "data":
                data.append(value)


def compaction_counts(pg: psycopg.Connection[Any], service: str, path: str) -> tuple[int, int]:
    """(compactions run, snapshots stored) of a document, read from the database."""
    row = pg.execute(
        "SELECT d.compactions, (SELECT count(*) FROM yjs_snapshot AS s"
        " WHERE s.document_id = d.stream_id) FROM yjs_document AS d"
        " WHERE d.service = %s AND d.path = %s",
        (service, path),
    ).fetchone()
    assert row is not None, f"no document {service}/{path}"
    return row[0], row[1]


# -- Updates compaction cannot merge (YJS-PROTOCOL.md 8, 12.3) -----------------------------------

# Yjs updates (v1) that decode, so the server used to accept them, but that pycrdt cannot turn
# into a snapshot: each one made every later compaction of its document fail. Found by
# mutation fuzzing of real updates (truncations, bit flips, huge varints), then reduced.
UNMERGEABLE_UPDATES: dict[str, bytes] = {
    # 43 bytes. Client 1 writes "hello world" into the root text "content" (clocks 0-10), and
    # "hello again" whose parent is the item 1#0: a string, not a type. Yrs cannot integrate
    # it ("block parent <1#0> must be deleted or shared ref type").
    "child-of-a-string": bytes.fromhex(
        "01020100040107636f6e74656e740b68656c6c6f20776f726c64040001000b68656c6c6f20616761696e00"
    ),
    # A GC struct of length 0 (client 7, clock 1): encoding the document panics (divide by 0).
    "empty-gc": bytes.fromhex("01010701000000"),
    # A GC struct of 7 clocks at clock 2^32 - 1, past Yrs's 32-bit clocks, and a deletion of
    # clock 2 of the same client: integrating it panics (index out of bounds).
    "gc-at-clock-2^32": bytes.fromhex("010107ffffffff0f00070107010201"),
    # An item of content type 18 (there is no such type) in the root "a": it decodes, but the
    # document encodes it as JSON content that cannot be decoded, an unreadable snapshot.
    "unknown-content-type": bytes.fromhex("0101070012010161000000"),
    # Four structs of client 1 from clock 2^40 - 1 (past Yrs's 32-bit clocks), nested types
    # among them: integrating them panics ("called `Option::unwrap()` on a `None` value").
    "huge-clock-nested-types": bytes.fromhex(
        "010401ffffffffff1f070101780301702801011601610177016207000116060400011802686900"
    ),
}

# Pairs of updates that each merge on their own, but not together: a POST cannot refuse the
# second without merging it with the whole document (a compaction per POST), so compaction
# meets them, and must record the failure and go on.
UNMERGEABLE_PAIRS: dict[str, tuple[bytes, bytes]] = {
    # Client 1 writes "hello" into the root text "content" (item 1#0); then client 2 inserts
    # "x" into the item 1#0 as its parent, a string, not a type (alone it waits for 1#0).
    "child-of-a-string": (
        bytes.fromhex("01010100040107636f6e74656e740568656c6c6f00"),
        bytes.fromhex("0101020004000100017800"),
    ),
    # A deletion of clocks 1-13 of client 7 (alone it waits for them), and client 7 setting
    # key "k" of the root map "m" at a clock near 2^32: together, integrating panics.
    "deletion-and-huge-clock": (
        bytes.fromhex("000107010d01"),
        bytes.fromhex("010107ffffdfff0f2801016d016b017c3f80000000"),
    ),
}
