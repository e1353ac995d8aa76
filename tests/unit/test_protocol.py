"""Unit tests of the pure wire rules (``streams.protocol``), no database or server."""

from __future__ import annotations

import base64
import json
import random
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.errors import BadRequest
from streams.http.request import stream_path
from streams.protocol import cursor, json_mode, sse
from streams.protocol.headers import (
    is_text_for_sse,
    is_true,
    media_type,
    parse_expires_at,
    parse_producer,
    parse_ttl,
)
from streams.protocol.offsets import Offset, parse, parse_read_offset


class TestOffsets:
    """PROTOCOL.md 8: opaque, lexicographically sortable, never a sentinel."""

    def test_format_is_fixed_width(self) -> None:
        assert str(Offset(0, 0)) == "0000000000000000_0000000000000000"
        assert str(Offset(12, 3456)) == "0000000000000012_0000000000003456"

    @given(
        st.tuples(st.integers(0, 10**15), st.integers(0, 10**15)),
        st.tuples(st.integers(0, 10**15), st.integers(0, 10**15)),
    )
    def test_lexical_order_is_stream_order(self, a: tuple[int, int], b: tuple[int, int]) -> None:
        assert (str(Offset(*a)) < str(Offset(*b))) == (Offset(*a) < Offset(*b))

    @given(st.integers(0, 10**16 - 1), st.integers(0, 10**16 - 1))
    def test_round_trip(self, seq: int, pos: int) -> None:
        assert parse(str(Offset(seq, pos))) == Offset(seq, pos)

    @pytest.mark.parametrize(
        "text",
        ["", "0,1", "0 1", "abc", "1_2", "0000000000000000_000000000000000", "../x",
         "0000000000000000_0000000000000000\n", "0000000000000000_0000000000000000\x00",
         "-2", "NOW"],
    )  # fmt: skip
    def test_malformed_offsets_are_400(self, text: str) -> None:
        with pytest.raises(BadRequest):
            parse(text)

    def test_sentinels(self) -> None:
        assert parse_read_offset([]).beginning
        assert parse_read_offset(["-1"]).beginning
        assert parse_read_offset(["-1"]).offset is None
        assert not parse_read_offset(["0000000000000000_0000000000000000"]).beginning
        assert parse_read_offset(["now"]).at_tail
        with pytest.raises(BadRequest):
            parse_read_offset(["-1", "now"])


class TestHeaders:
    @pytest.mark.parametrize("value", ["0", "1", "3600", "99999"])
    def test_valid_ttl(self, value: str) -> None:
        """PROTOCOL.md 5.1: decimal without sign, leading zeros, fraction or exponent."""
        assert parse_ttl(value) == int(value)

    @pytest.mark.parametrize(
        "value", ["", "-1", "+60", "00060", "60.5", "1e3", "abc", " 60", "60\n"]
    )
    def test_invalid_ttl(self, value: str) -> None:
        with pytest.raises(BadRequest):
            parse_ttl(value)

    @pytest.mark.parametrize(
        "value",
        ["2030-01-02T03:04:05Z", "2030-01-02T03:04:05.123Z", "2030-01-02T03:04:05.123+00:00",
         "2030-01-02T05:04:05+02:00", "2030-01-02T03:04:05.123456789Z"],
    )  # fmt: skip
    def test_valid_expires_at(self, value: str) -> None:
        moment = parse_expires_at(value)
        assert moment.tzinfo is not None
        assert moment.replace(microsecond=0) in (datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),)

    @pytest.mark.parametrize(
        "value", ["not-a-timestamp", "2030-01-02", "2030-13-02T03:04:05Z", "2030-01-02T03:04:05"]
    )
    def test_invalid_expires_at(self, value: str) -> None:
        with pytest.raises(BadRequest):
            parse_expires_at(value)

    @pytest.mark.parametrize(("value", "closed"), [("true", True), ("TRUE", True), ("True", True),
                                                    ("false", False), ("1", False), ("", False),
                                                    (None, False), ("yes", False)])  # fmt: skip
    def test_stream_closed_only_true(self, value: str | None, closed: bool) -> None:
        """PROTOCOL.md 4.1: only `true` (any case) counts; other values are ignored."""
        assert is_true(value) is closed

    def test_media_type_normalisation(self) -> None:
        """Content types compare by media type, case-insensitively, without parameters."""
        assert media_type("Application/JSON; charset=utf-8") == "application/json"
        assert media_type("text/plain") == "text/plain"
        with pytest.raises(BadRequest):
            media_type("not a type")

    def test_media_type_whitespace_is_ows(self) -> None:
        """RFC 9110 5.6.3: space and tab around the type are optional whitespace, as the
        store's ds_media_type trims them; no other blank is."""
        assert media_type(" \tapplication/json\t ;charset=utf-8") == "application/json"
        for blank in ("\xa0", "\x85", "\u2003", "\n"):
            with pytest.raises(BadRequest):
                media_type(f"application/json{blank};charset=utf-8")

    def test_sse_encoding_choice(self) -> None:
        """PROTOCOL.md 5.8: text/* and JSON are UTF-8, everything else base64."""
        assert is_text_for_sse("text/markdown")
        assert is_text_for_sse("application/json")
        assert not is_text_for_sse("application/octet-stream")
        assert not is_text_for_sse("application/ndjson")

    def test_producer_headers(self) -> None:
        """PROTOCOL.md 5.2.1: all three or none; integers in [0, 2^53-1]."""
        assert parse_producer(None, None, None) is None
        tuple_ = parse_producer("p", "1", "2")
        assert tuple_ is not None and (tuple_.producer_id, tuple_.epoch, tuple_.seq) == ("p", 1, 2)
        for partial in [("p", None, None), (None, "0", "0"), ("p", "0", None)]:
            with pytest.raises(BadRequest):
                parse_producer(*partial)
        for bad in ["-1", "1abc", "1e3", "0x1", str(2**53), "01", ""]:
            with pytest.raises(BadRequest):
                parse_producer("p", bad, "0")
        with pytest.raises(BadRequest):
            parse_producer("", "0", "0")


class TestJsonMode:
    """PROTOCOL.md 9.1."""

    def test_flattens_one_level(self) -> None:
        assert json_mode.messages_for_append(b'{"a": 1}') == [b'{"a":1}']
        assert json_mode.messages_for_append(b"[1, [2, 3], null]") == [b"1", b"[2,3]", b"null"]
        assert json_mode.messages_for_append(b"[[[1]]]") == [b"[[1]]"]

    def test_empty_array(self) -> None:
        with pytest.raises(BadRequest):
            json_mode.messages_for_append(b"[]")
        assert json_mode.messages_for_create(b"[]") == []
        assert json_mode.messages_for_create(b"") == []

    @pytest.mark.parametrize(
        "body",
        [
            b"{ invalid json }",
            b"NaN",
            b"[1, Infinity]",
            b"\xff\xfe",
            b"{} {}",
            b"",
            b"[1,]",
            b"1e400",
            b"[-1e999]",
        ],
    )
    def test_invalid_json(self, body: bytes) -> None:
        with pytest.raises(BadRequest):
            json_mode.messages_for_append(body)

    def test_lone_surrogate_stays_escaped(self) -> None:
        (message,) = json_mode.messages_for_append(b'"\\ud800"')
        assert json.loads(message) == "\ud800"

    @given(st.lists(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                                 lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
                                 max_leaves=10), min_size=1))  # fmt: skip
    def test_read_renders_what_was_appended(self, values: list[object]) -> None:
        messages = json_mode.messages_for_append(json.dumps(values).encode())
        assert json.loads(json_mode.render(b",".join(messages))) == values


class TestSse:
    """PROTOCOL.md 5.8 framing."""

    def test_text_lines_and_injection(self) -> None:
        event = sse.data_event(b"a\r\nevent: control\rdata: x\n b", base64_encoded=False)
        assert event == (b"event: data\ndata:a\ndata:event: control\ndata:data: x\ndata:  b\n\n")

    def test_base64_lines_decode(self) -> None:
        payload = bytes(range(256)) * 3
        event = sse.data_event(payload, base64_encoded=True)
        lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
        assert all(len(line) % 4 == 0 for line in lines)
        assert base64.b64decode(b"".join(lines)) == payload

    def test_control_event(self) -> None:
        open_event = sse.control_event(next_offset="o", cursor="7", up_to_date=True, closed=False)
        expected = b'{"streamNextOffset":"o","streamCursor":"7","upToDate":true}'
        assert open_event == b"event: control\ndata:" + expected + b"\n\n"
        closed = json.loads(
            sse.control_event(next_offset="o", cursor="7", up_to_date=False, closed=True).split(
                b"data:"
            )[1]
        )
        assert closed == {"streamNextOffset": "o", "upToDate": True, "streamClosed": True}


class TestCursor:
    """PROTOCOL.md 10.1: interval cursors that never go backwards."""

    def test_interval_from_epoch(self) -> None:
        assert cursor.current_interval(cursor.EPOCH_SECONDS + 45) == 2

    def test_echoed_cursor_moves_forward(self) -> None:
        now = cursor.EPOCH_SECONDS + 1000
        current = cursor.current_interval(now)
        assert int(cursor.next_cursor(str(current), now)) > current
        assert int(cursor.next_cursor(str(current + 500), now)) > current + 500
        assert cursor.next_cursor(str(current - 5), now) == str(current)
        assert cursor.next_cursor("garbage", now) == str(current)

    def test_a_long_echoed_cursor_moves_forward_too(self) -> None:
        """A MUST of 10.1 for any cursor at or past the interval: one of 27 digits (leading
        zeros, or a value past 10^18) got the current interval back, lower than itself."""
        now = cursor.EPOCH_SECONDS + 1000
        for echoed in ("000000000000000000099999999", "9" * 19, "1" + "0" * 63):
            assert int(cursor.next_cursor(echoed, now)) > int(echoed)
        # Past 64 digits it is not read as a number: the current interval.
        assert cursor.next_cursor("1" * 65, now) == str(cursor.current_interval(now))


class TestStreamPaths:
    """PROTOCOL.md 12.2: no traversal through stream paths."""

    def test_plain_and_nested(self) -> None:
        assert stream_path("a/b/c") == "a/b/c"
        assert stream_path("caf%C3%A9") == "café"

    @pytest.mark.parametrize(
        "encoded",
        ["", "a//b", "../x", "a/../b", "a/%2e%2e/b", "%2E", "a/%2e", "a%00b", "%ff", "a/",
         "__ds/subscriptions/x", "x" * 1100, "a%0Ab"],
    )  # fmt: skip
    def test_rejected(self, encoded: str) -> None:
        with pytest.raises(BadRequest):
            stream_path(encoded)


def _nested_document(rng: random.Random, depth: int) -> object:
    """A JSON value exactly ``depth`` deep, with strings that hold brackets, quotes and escapes."""
    noise = ["[", "]", "{", "}", '"', "\\", "\\\\", '\\"', "a", ",", "\u2028", "é"]
    text = "".join(rng.choice(noise) for _ in range(rng.randint(0, 12)))
    if depth == 0:
        return rng.choice([1, text, None])
    inner = _nested_document(rng, depth - 1)
    siblings = [text, [], {}] if depth > 1 else [text]
    if rng.random() < 0.5:
        return [rng.choice(siblings), inner]
    return {text: inner, "x": rng.choice(siblings)}


def test_the_json_depth_check_is_exact() -> None:
    """``json_mode._too_deep`` against the depth of random documents around the limit (the
    review's fuzzing of the check, kept)."""
    rng = random.Random(128)
    for _ in range(600):
        depth = rng.randint(120, 136)
        body = json.dumps(_nested_document(rng, depth), ensure_ascii=rng.random() < 0.5)
        assert json_mode._too_deep(body.encode()) == (depth > json_mode.MAX_JSON_DEPTH), depth
