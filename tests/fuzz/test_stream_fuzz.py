"""Stateful fuzzing of ``/v1/stream/<path>`` against a model of what each stream holds.

A Hypothesis state machine sends PUT, POST, GET (catch-up, long-poll, SSE), HEAD, DELETE,
OPTIONS and unknown methods to a handful of streams (spelled with any percent-encoding) and to
paths that must be refused, with every protocol header drawn valid, at a boundary, huge,
non-ASCII, with NUL, or duplicated, and bodies of valid and invalid JSON, text and binary.

After every request the target stream (and a fork's source) is re-read, HEAD then GET from
``-1`` page by page, and compared with the model:

* a refused request (4xx, or a connection the HTTP parser closed) changed nothing;
* an accepted one changed exactly what its status says (an append stored its body, a create
  made the stream its body describes, a fork holds a prefix of its source, a delete removed);
* no answer is a 5xx, and every answer comes within the time bound (support.RawHttp).

Streams created with a short TTL or an expiry date may disappear at any time; the model allows
that and nothing else.
"""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tests.fuzz import strategies as s
from tests.fuzz.support import (
    TALLY,
    RawHttp,
    Reply,
    describe,
    examples,
    fuzz_settings,
    json_or_none,
    sse_events,
)

ROUTE = "/v1/stream/"
Header = tuple[bytes, bytes]
MUTATING = {"PUT", "POST", "DELETE"}
MAX_PAGES = 64


def header(headers: list[Header], name: str) -> str | None:
    """A header as the server sees it: repeated ones joined with ', ' (RFC 9110 5.3)."""
    wanted = name.lower().encode()
    values = [value.decode("latin-1") for key, value in headers if key.lower() == wanted]
    return ", ".join(values) if values else None


def is_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() == "true"


def media(content_type: str | None) -> str:
    if not content_type:
        return "application/octet-stream"
    return content_type.split(";", 1)[0].strip(" \t").lower()


def parse_json(body: bytes) -> Any:
    """The JSON text of a body as PROTOCOL.md 9.1 defines it; ValueError if it is not one."""
    text = body.decode("utf-8").removeprefix("\ufeff")

    def constant(name: str) -> Any:
        raise ValueError(name)

    value = json.loads(text, parse_constant=constant)
    if "Infinity" in repr(value) and "inf" in repr(value):
        raise ValueError("not finite")
    return value


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    return True


@dataclass
class Snapshot:
    """A stream as a re-read sees it."""

    exists: bool
    content_type: str | None = None
    tail: str | None = None
    closed: bool = False
    content: Any = None  # bytes, or the list of JSON messages

    def key(self) -> tuple[Any, ...]:
        return (self.exists, self.content_type, self.tail, self.closed, self.content)

    def __repr__(self) -> str:
        shown = repr(self.content)
        if len(shown) > 240:
            shown = f"{shown[:240]}...({len(self.content)} items)"
        return (
            f"Snapshot(exists={self.exists}, content_type={self.content_type!r}, "
            f"tail={self.tail}, closed={self.closed}, content={shown})"
        )


@dataclass
class Model:
    """What the fuzzer knows of one stream: its last verified state, and whether it may expire."""

    state: Snapshot = field(default_factory=lambda: Snapshot(exists=False))
    volatile: bool = False

    @property
    def json(self) -> bool:
        return media(self.state.content_type) == "application/json"


class StreamFuzz(RuleBasedStateMachine):
    port: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.http = RawHttp(self.port)
        prefix = f"fuzz/{uuid.uuid4().hex[:12]}"
        self.names = [
            f"{prefix}/a",
            f"{prefix}/b/c",
            f"{prefix}/\u00fc \u00f1-\u6f22",
            f"{prefix}/x.y%25z",
            f"{prefix}/" + "L" * 300,
        ]
        self.random_prefix = f"fuzz-other/{uuid.uuid4().hex[:12]}/"
        self.models = {name: Model() for name in self.names}
        self.etags: list[str] = ['"none"']
        self.steps = 0
        self.broken = False  # an invariant failed: the model is no longer to be trusted

    def teardown(self) -> None:
        try:
            # Only after a run that passed: after a failure the model no longer holds.
            intact = sys.exc_info()[0] is None and not self.broken
            for name in self.names if intact else []:
                self._verify_unchanged(name, "the final re-read")
        finally:
            self.http.close()

    # -- sending and re-reading -----------------------------------------------------------------

    def send(
        self,
        method: str,
        target: str,
        headers: list[Header],
        body: bytes | None,
        *,
        sse: bool = False,
    ) -> Reply:
        self.steps += 1
        self.last = (method, target, headers, body)
        reply = self.http.send(method, target.encode("utf-8"), headers, body, sse=sse)
        etag = reply.header("ETag")
        if etag and len(self.etags) < 50:
            self.etags.append(etag)
        return reply

    def read(self, name: str) -> Snapshot:
        """HEAD, then GET from -1 following Stream-Next-Offset until Stream-Up-To-Date."""
        url = ROUTE + _quote(name)
        head = self.http.send("HEAD", url, check=True)
        if head.status in (404, 410):  # missing, or deleted while forks read through it
            return Snapshot(exists=False)
        assert head.status == 200, (head.status, head.body)
        content_type = head.header("Content-Type")
        is_json = media(content_type) == "application/json"
        content: Any = [] if is_json else b""
        offset = "-1"
        for _ in range(MAX_PAGES):
            page = self.http.send("GET", f"{url}?offset={offset}", check=True)
            if page.status in (404, 410):  # expired between the HEAD and the GET
                return Snapshot(exists=False)
            assert page.status == 200, (page.status, page.body)
            if is_json:
                values = json.loads(page.body)
                assert isinstance(values, list), page.body[:200]
                content += values
            else:
                content += page.body
            next_offset = page.header("Stream-Next-Offset")
            assert next_offset is not None
            if page.header("Stream-Up-To-Date") == "true":
                break
            assert next_offset != offset, "a read that is not up to date did not advance"
            offset = next_offset
        else:
            raise AssertionError(f"{name}: more than {MAX_PAGES} pages")
        return Snapshot(
            exists=True,
            content_type=content_type,
            tail=head.header("Stream-Next-Offset"),
            closed=head.header("Stream-Closed") == "true",
            content=content,
        )

    def _last(self) -> str:
        method, target, headers, body = self.last
        return describe(method.encode(), target.encode("utf-8"), headers, body)

    def _verify_unchanged(self, name: str, why: str) -> None:
        model = self.models[name]
        seen = self.read(name)
        if seen.key() == model.state.key():
            return
        if model.volatile and not seen.exists:
            model.state = seen  # expired: allowed for streams with a TTL or an expiry date
            return
        message = (
            f"stream {_short(name)!r} changed after {why}: expected {model.state!r}, "
            f"read {seen!r}; last request: {self._last() if self.steps else None}"
        )
        self.fail(message)

    def _expect(self, name: str, seen: Snapshot, expected: Snapshot, why: str) -> None:
        if seen.key() != expected.key():
            message = (
                f"{why} on {_short(name)!r}: expected {expected!r}, read {seen!r}; "
                f"request: {self._last()}"
            )
            self.fail(message)

    def fail(self, message: str) -> None:
        self.broken = True
        TALLY.partial_writes.append(message)
        raise AssertionError(message)

    # -- targets --------------------------------------------------------------------------------

    def clean(self, data: st.DataObject) -> bool:
        """Seven requests in ten are well formed (so streams fill, close and fork); the rest
        carry malformed, boundary or duplicated values."""
        return data.draw(st.integers(0, 9), label="well formed?") < 7

    def target(self, data: st.DataObject) -> tuple[str, str]:
        name = data.draw(st.sampled_from(self.names), label="stream")
        return name, ROUTE + data.draw(s.encodings(name), label="spelling")

    def query(self, data: st.DataObject, name: str) -> str:
        offsets = ["-1", "now", "", "abc", "0" * 16 + "_" + "0" * 16, "9" * 16 + "_" + "9" * 16]
        tail = self.models[name].state.tail
        if tail:
            offsets += [tail, tail, tail[:-1] + "9"]
        parts = []
        if data.draw(st.integers(0, 9), label="has offset") > 0:
            parts.append("offset=" + s.pick(data, offsets, label="offset"))
        live = data.draw(
            st.sampled_from([None, None, "long-poll", "sse", "", "false", "websocket", "SSE"]),
            label="live",
        )
        if live is not None:
            parts.append(f"live={live}")
        cursor = data.draw(st.sampled_from([None, "1", "999999999999999999999", "x", "-1"]))
        if cursor is not None:
            parts.append(f"cursor={cursor}")
        extra = data.draw(
            st.sampled_from([None, "offset=-1", "live=sse", "x=%ff", "%00=1", "offset"])
        )
        if extra is not None:
            parts.append(extra)
        return "&".join(parts)

    # -- rules ----------------------------------------------------------------------------------

    @rule(data=st.data())
    def create(self, data: st.DataObject) -> None:
        name, url = self.target(data)
        clean = self.clean(data)
        headers = data.draw(
            s.header_set(
                {
                    b"Content-Type": s.valid_content_type if clean else s.content_type,
                    b"Stream-TTL": s.valid_ttl if clean else s.ttl,
                    b"Stream-Expires-At": s.valid_expires_at if clean else s.expires_at,
                    b"Stream-Closed": s.closed,
                },
                clean=clean,
            ),
            label="headers",
        )
        if clean and header(headers, "Stream-TTL") and header(headers, "Stream-Expires-At"):
            headers = [h for h in headers if h[0] != b"Stream-Expires-At"]
        ctype = media(header(headers, "Content-Type"))
        valid_body = s.valid_json_body if ctype == "application/json" else s.raw_body
        body = data.draw(st.one_of(st.none(), valid_body) if clean else s.any_body, label="body")
        reply = self.send("PUT", url, headers, body)
        self.after_create(name, headers, body, reply, source=None)

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        name, url = self.target(data)
        source = data.draw(st.sampled_from(self.names), label="source")
        spelled = data.draw(
            st.sampled_from([ROUTE + _quote(source), _quote(source), "/" + _quote(source)]),
            label="source spelling",
        )
        offsets = [b"bogus", b"0000000000000000_0000000000000000"]
        tail = self.models[source].state.tail
        if tail:
            offsets += [tail.encode()] * 3 + [tail[:-1].encode() + b"7"]
        clean = self.clean(data)
        headers = data.draw(
            s.header_set(
                {
                    b"Content-Type": s.valid_content_type if clean else s.content_type,
                    b"Stream-TTL": s.valid_ttl if clean else s.ttl,
                    b"Stream-Fork-Offset": st.integers(0, 255).map(
                        lambda i: (offsets[2:] if clean and tail else offsets)[
                            i % len(offsets[2:] if clean and tail else offsets)
                        ]
                    ),
                    b"Stream-Fork-Sub-Offset": s.valid_fork_sub_offset
                    if clean
                    else s.fork_sub_offset,
                    b"Stream-Closed": s.closed,
                },
                clean=clean,
            ),
            label="headers",
        )
        source_header = st.just(spelled.encode())
        headers.append(
            (b"Stream-Forked-From", data.draw(source_header if clean else s.mangled(source_header)))
        )
        body = data.draw(st.one_of(st.none(), s.raw_body if clean else s.any_body), label="body")
        reply = self.send("PUT", url, headers, body)
        self.after_create(name, headers, body, reply, source=source)

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        self._append(data)

    @rule(data=st.data())
    def append_more(self, data: st.DataObject) -> None:
        """Appends are what most requests to a stream are: twice the weight of other rules."""
        self._append(data)

    def _append(self, data: st.DataObject) -> None:
        name, url = self.target(data)
        model = self.models[name]
        ctype = model.state.content_type
        clean = self.clean(data)
        # Strategies of the same shape whatever the stream is (Hypothesis replays draws).
        own = (ctype or "application/octet-stream").encode()
        if clean:
            content_types = s.valid_content_type.map(lambda v: own if ctype else v)
        else:
            content_types = st.one_of(st.just(own), s.content_type)
        options = {
            b"Stream-Seq": s.valid_stream_seq if clean else s.stream_seq,
            b"Stream-Closed": s.closed,
        }
        headers = data.draw(s.header_set(options, clean=clean), label="headers")
        if data.draw(st.booleans(), label="producer"):
            headers += [
                (b"Producer-Id", data.draw(s.valid_producer_id if clean else s.producer_id)),
                (b"Producer-Epoch", data.draw(s.valid_producer_int if clean else s.producer_int)),
                (b"Producer-Seq", data.draw(s.valid_producer_int if clean else s.producer_int)),
            ]
            if not clean and data.draw(st.integers(0, 8)) == 0:
                headers.pop(data.draw(st.integers(-3, -1)))  # an incomplete producer tuple
        if clean or data.draw(st.integers(0, 5)) > 0:
            headers.append((b"Content-Type", data.draw(content_types)))
        json_body = data.draw(s.valid_json_body if clean else s.json_body, label="JSON body")
        other_body = data.draw(s.raw_body if clean else s.any_body, label="other body")
        body = json_body if model.json else other_body
        if (
            clean
            and data.draw(st.integers(0, 9)) == 0
            and is_true(header(headers, "Stream-Closed"))
        ):
            body = b""  # a close-only request
        reply = self.send("POST", url, headers, body)
        self.after_append(name, headers, body, reply)

    @rule(data=st.data())
    def read_stream(self, data: st.DataObject) -> None:
        name, url = self.target(data)
        query = self.query(data, name)
        etags = [e.encode() for e in self.etags]
        headers = data.draw(
            s.header_set(
                {b"If-None-Match": st.integers(0, 255).map(lambda i: etags[i % len(etags)])}
            ),
            label="headers",
        )
        sse = "live=sse" in query
        reply = self.send("GET", f"{url}?{query}" if query else url, headers, None, sse=sse)
        if reply.status == 200 and sse:
            kinds = [kind for kind, _ in sse_events(reply.body)]
            assert "control" in kinds or not reply.body, reply.body[:300]
        plain = reply.status == 200 and not sse and "live=" not in query
        if plain and media(reply.header("Content-Type")) == "application/json":
            assert isinstance(json_or_none(reply.body), list), reply.body[:300]
        self._verify_unchanged(name, f"GET ({reply.status})")

    @rule(data=st.data())
    def head_stream(self, data: st.DataObject) -> None:
        _, url = self.target(data)
        headers = data.draw(s.header_set({}), label="headers")
        reply = self.send("HEAD", url, headers, None)
        assert reply.status in (200, 400, 404, 410, 0), reply.status
        assert reply.body == b""

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name, url = self.target(data)
        headers = data.draw(s.header_set({}), label="headers")
        body = data.draw(st.one_of(st.none(), st.just(b"x")), label="body")
        reply = self.send("DELETE", url, headers, body)
        model = self.models[name]
        if 200 <= reply.status < 300:
            assert reply.status == 204, reply.status
            assert model.state.exists or model.volatile, f"deleted a missing stream: {reply}"
            seen = self.read(name)
            self._expect(name, seen, Snapshot(exists=False), "a 204 DELETE")
            model.state = seen
        else:
            if not model.state.exists and not model.volatile:
                assert reply.status in (404, 410, 400, 0), reply.status
            self._verify_unchanged(name, f"a refused DELETE ({reply.status})")

    @rule(data=st.data())
    def other_method(self, data: st.DataObject) -> None:
        name, url = self.target(data)
        method = data.draw(
            st.sampled_from(
                ["OPTIONS", "PATCH", "TRACE", "PROPFIND", "CONNECT", "FOO", "get", "MKCOL"]
            ),
            label="method",
        )
        headers = data.draw(
            s.header_set(
                {
                    b"Access-Control-Request-Method": st.just(b"POST"),
                    b"Access-Control-Request-Headers": s.mangled(st.just(b"content-type")),
                }
            ),
            label="headers",
        )
        body = data.draw(st.one_of(st.none(), st.just(b"x")), label="body")
        reply = self.send(method, url, headers, body)
        if method == "OPTIONS":
            assert reply.status in (204, 400, 0), reply.status
        self._verify_unchanged(name, f"{method} ({reply.status})")

    @rule(data=st.data())
    def bad_path(self, data: st.DataObject) -> None:
        """Paths that are not streams (traversal, NUL, invalid UTF-8, reserved, too long) are
        refused whatever the method; random new names are just other streams."""
        suffix = data.draw(
            st.one_of(
                st.sampled_from(s.BAD_STREAM_SUFFIXES),
                st.sampled_from(s.ODD_STREAM_SUFFIXES).map(lambda x: self.random_prefix + x),
                st.text(min_size=1, max_size=30).map(
                    lambda t: self.random_prefix + _quote(t, safe="/%")
                ),
            ),
            label="path",
        )
        method = data.draw(st.sampled_from(["PUT", "POST", "GET", "HEAD", "DELETE"]))
        headers = data.draw(s.header_set({b"Content-Type": s.content_type}), label="headers")
        body = data.draw(st.one_of(st.none(), s.raw_body), label="body")
        query = data.draw(st.sampled_from(["", "?offset=-1", "?offset=now&live=long-poll"]))
        reply = self.send(method, ROUTE + suffix + query, headers, body)
        if suffix in s.BAD_STREAM_SUFFIXES:
            assert reply.status in (400, 404, 0), (suffix, reply.status)

    @invariant()
    def every_stream_as_modelled(self) -> None:
        """Every 20 steps, every stream is re-read: what no request targeted did not change."""
        if self.steps and self.steps % 20 == 0:
            for name in self.names:
                self._verify_unchanged(name, "unrelated requests")

    # -- what an answer implies -----------------------------------------------------------------

    def after_create(
        self,
        name: str,
        headers: list[Header],
        body: bytes | None,
        reply: Reply,
        *,
        source: str | None,
    ) -> None:
        model = self.models[name]
        if reply.status == 201:
            if model.state.exists and not model.volatile:
                raise AssertionError(f"201 for a stream that exists: {self._last()}")
            seen = self.read(name)
            volatile = _volatile(headers) or (source is not None and self.models[source].volatile)
            if not seen.exists and volatile:
                model.state, model.volatile = seen, volatile
                return
            assert seen.exists, f"201 but the stream is missing: {self._last()}"
            if source is None:
                expected = Snapshot(
                    exists=True,
                    content_type=seen.content_type,
                    tail=seen.tail,
                    closed=is_true(header(headers, "Stream-Closed")),
                    content=self._initial(seen, body),
                )
                self._expect(name, seen, expected, "a 201 create")
            else:
                self._check_fork(name, source, seen, headers)
            model.state, model.volatile = seen, volatile
        elif reply.status == 200:
            assert model.state.exists or model.volatile, f"200 for a missing stream: {self._last()}"
            self._verify_unchanged(name, "an idempotent create (200)")
        else:
            assert reply.status >= 400 or reply.status == 0, reply.status
            self._verify_unchanged(name, f"a refused create ({reply.status})")
        if source is not None and source != name:
            self._verify_unchanged(source, "a fork of it")

    def _initial(self, seen: Snapshot, body: bytes | None) -> Any:
        body = body or b""
        if media(seen.content_type) != "application/json":
            return body
        if not body.strip(b" \t\r\n"):
            return []
        try:
            value = parse_json(body)
        except (ValueError, RecursionError):
            raise AssertionError(
                f"a create with invalid JSON was accepted: {self._last()}"
            ) from None
        assert _finite(value), f"a create with non-finite JSON was accepted: {self._last()}"
        return value if isinstance(value, list) else [value]

    def _check_fork(self, name: str, source: str, seen: Snapshot, headers: list[Header]) -> None:
        origin = self.models[source].state
        assert origin.exists or self.models[source].volatile, f"forked a missing source: {name}"
        if not origin.exists:
            return
        inherited = seen.content[: len(origin.content)]
        assert origin.content[: len(inherited)] == inherited, (
            f"fork {name!r} does not start with its source's data: {seen!r} vs {origin!r}"
        )
        if header(headers, "Stream-Fork-Offset") is None and not header(
            headers, "Stream-Fork-Sub-Offset"
        ):
            assert inherited == origin.content, f"a fork at the tail lost data: {seen!r}"

    def after_append(
        self, name: str, headers: list[Header], body: bytes | None, reply: Reply
    ) -> None:
        model = self.models[name]
        if not 200 <= reply.status < 300:
            if reply.status == 0 or reply.status >= 400:
                self._verify_unchanged(name, f"a refused append ({reply.status})")
                return
            raise AssertionError(f"unexpected {reply.status} to an append: {self._last()}")
        assert model.state.exists or model.volatile, f"appended to a missing stream: {self._last()}"
        producer = header(headers, "Producer-Id") is not None
        stored = bool(body) and (reply.status == 200 if producer else reply.status == 204)
        assert reply.status == 204 or producer, reply.status
        seen = self.read(name)
        if not seen.exists and model.volatile:
            model.state = seen
            return
        old = model.state
        if stored:
            assert not old.closed, f"an append to a closed stream was accepted: {self._last()}"
            content = old.content + self._messages(model, body or b"")
        else:
            content = old.content
        closing = is_true(header(headers, "Stream-Closed"))
        if stored or not body:
            closed = old.closed or closing  # an append or a close-only request
        else:
            closed = seen.closed if closing else old.closed  # a producer's duplicate
        expected = Snapshot(
            exists=True,
            content_type=old.content_type,
            tail=seen.tail if stored else old.tail,
            closed=closed,
            content=content,
        )
        self._expect(name, seen, expected, f"an accepted append ({reply.status})")
        if stored:
            assert seen.tail != old.tail, f"an append did not move the tail: {self._last()}"
        model.state = seen

    def _messages(self, model: Model, body: bytes) -> Any:
        if not model.json:
            return body
        try:
            value = parse_json(body)
        except (ValueError, RecursionError):
            raise AssertionError(
                f"an append of invalid JSON was accepted: {self._last()}"
            ) from None
        assert _finite(value), f"an append of non-finite JSON was accepted: {self._last()}"
        assert value != [], f"an empty JSON array was accepted: {self._last()}"
        return value if isinstance(value, list) else [value]


def _short(name: str) -> str:
    return name if len(name) < 60 else f"{name[:40]}...({len(name)} chars)"


def _quote(text: str, safe: str = "/") -> str:
    from urllib.parse import quote

    return quote(text, safe=safe)


def _volatile(headers: list[Header]) -> bool:
    """May a stream created with these headers expire while the fuzzer runs?"""
    ttl = header(headers, "Stream-TTL")
    expires = header(headers, "Stream-Expires-At")
    if ttl is None and expires is None:
        return False
    return not (ttl in s.LONG_TTLS and expires is None) and not (
        expires in s.LONG_EXPIRES and ttl is None
    )


def test_stream_protocol_fuzz(fuzz_server: Any) -> None:
    """The state machine above: ``FUZZ_SCALE`` x 14 runs of 40 steps each."""
    StreamFuzz.port = fuzz_server.port
    run_state_machine_as_test(
        StreamFuzz,
        settings=fuzz_settings(max_examples=examples(14), stateful_step_count=40),
    )
