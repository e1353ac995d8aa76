"""Hypothesis strategies for what the fuzzers send: header values (valid, boundary, huge,
non-ASCII, NUL, duplicated), bodies (JSON valid and not, text, binary) and URL paths."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

Header = tuple[bytes, bytes]

MAX_SAFE = 2**53 - 1
MAX_TTL = 100 * 365 * 24 * 3600


def pick(data: st.DataObject, items: list[Any], label: str = "pick") -> Any:
    """One of ``items``, a list whose length may depend on what the server answered: drawn
    with a fixed shape, so Hypothesis sees the same kind of choice on every run."""
    return items[data.draw(st.integers(0, 255), label=label) % len(items)]


def between(data: st.DataObject, low: int, high: int, label: str = "between") -> int:
    """An integer in [low, high] (bounds that may depend on state), drawn with a fixed shape."""
    return low + data.draw(st.integers(0, 2**16), label=label) % (high - low + 1)


# -- header values -----------------------------------------------------------------------------


def _b(values: list[str]) -> st.SearchStrategy[bytes]:
    return st.sampled_from([value.encode("utf-8") for value in values])


def mangled(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A valid value most of the time; otherwise one with NUL, non-ASCII, control or
    surrounding whitespace, a huge one, or a random byte string."""
    return st.one_of(
        valid,
        valid,
        valid,
        valid.map(lambda v: v + b"\x00"),
        valid.map(lambda v: b"\x00" + v),
        valid.map(lambda v: v + "é".encode()),
        valid.map(lambda v: v + b"\xff\xfe"),
        valid.map(lambda v: b" \t" + v + b"\t "),
        valid.map(lambda v: v * 600),
        st.binary(max_size=40),
        st.text(max_size=20).map(lambda t: t.encode("utf-8")),
    )


CONTENT_TYPES = [
    "text/plain", "application/json", "application/octet-stream", "text/plain; charset=utf-8",
    "application/json; charset=utf-8", "APPLICATION/JSON", "application/json\t;x=1",
    "text/markdown", "image/png",
]  # fmt: skip
BAD_CONTENT_TYPES = [
    "", " ", "???", "text/", "/plain", "text/plain/x", "application/json\xa0;a=b",
    "a" * 250 + "/b", "a" * 260 + "/b", "text/pläin", "application/json\x00",
]  # fmt: skip

valid_content_type = _b(CONTENT_TYPES)
content_type = st.one_of(
    _b(CONTENT_TYPES), _b(CONTENT_TYPES), _b(BAD_CONTENT_TYPES), mangled(_b(CONTENT_TYPES))
)

LONG_TTLS = ["3600", "86400", str(MAX_TTL)]
# Well-formed TTLs are long (or 0): a stream that expires while a run goes on would make the
# run's draws depend on the clock. Short ones are among the malformed and boundary values.
valid_ttl = st.one_of(_b(LONG_TTLS), _b(["0"]))
ttl = st.one_of(
    _b(LONG_TTLS),
    _b(["0", "1", "2", "59", str(MAX_TTL + 1), "007", "-1", "+5", "1.5", "1e3", "", " 60",
        "99999999999999999999999", "\u0663", "0x10", "60,60"]),
    st.integers(min_value=-5, max_value=2**70).map(lambda n: str(n).encode()),
    mangled(_b(LONG_TTLS)),
)  # fmt: skip
LONG_EXPIRES = ["2099-01-01T00:00:00Z", "2098-06-30T12:00:00.123456789+14:00"]
valid_expires_at = st.one_of(_b(LONG_EXPIRES), _b(["2000-01-01T00:00:00Z"]))
expires_at = st.one_of(
    _b(LONG_EXPIRES),
    _b(["2000-01-01T00:00:00Z", "1970-01-01T00:00:00Z", "0001-01-01T00:00:00Z",
        "9999-12-31T23:59:59Z", "9999-12-31T23:59:59-23:59", "2030-02-30T00:00:00Z",
        "2030-01-01T24:00:00Z", "2030-01-01 00:00:00Z", "2030-01-01t00:00:00z", "tomorrow",
        "2030-01-01T00:00:00", "2030-01-01T00:00:60Z", "2030-01-01T00:00:00.Z",
        "2030-01-01T00:00:00+99:99", "\uff12\uff10\uff13\uff10-01-01T00:00:00Z", ""]),
    st.datetimes().map(lambda d: (d.isoformat() + "Z").encode()),
    mangled(_b(LONG_EXPIRES)),
)  # fmt: skip
valid_stream_seq = st.integers(min_value=0, max_value=30).map(lambda n: f"{n:04d}".encode())
stream_seq = st.one_of(
    st.integers(min_value=0, max_value=30).map(lambda n: f"{n:04d}".encode()),
    _b(["", "a", "z" * 512, "z" * 513, "\u00e9", "0001\x00"]),
    mangled(_b(["0005"])),
)
closed = st.one_of(_b(["true", "TRUE", " true ", "True"]), _b(["false", "yes", "1", ""]))
valid_producer_id = _b(["p1", "p2", "\u00e9t\u00e9"])
producer_id = st.one_of(
    _b(["p1", "p2", "\u00e9t\u00e9"]), _b(["", " ", "x" * 512, "x" * 513]), mangled(_b(["p1"]))
)
valid_producer_int = st.integers(min_value=0, max_value=4).map(lambda n: str(n).encode())
producer_int = st.one_of(
    st.integers(min_value=0, max_value=4).map(lambda n: str(n).encode()),
    _b([str(MAX_SAFE), str(MAX_SAFE + 1), "-1", "01", " 1", "1.0", "1e2", "", "\u0661"]),
    st.integers(min_value=0, max_value=2**64).map(lambda n: str(n).encode()),
)
valid_fork_sub_offset = st.integers(min_value=0, max_value=12).map(lambda n: str(n).encode())
fork_sub_offset = st.one_of(
    st.integers(min_value=0, max_value=12).map(lambda n: str(n).encode()),
    _b(["-1", "1.0", "", "9" * 16, "9" * 15, "\u0661"]),
)
if_none_match = st.one_of(_b(['"x"', "*", '"' * 300, "", 'W/"1"', '"a", "b"']), mangled(_b(["*"])))

# Headers any request may carry besides its own: noise the server must shrug off.
benign_noise_header = st.one_of(
    st.tuples(st.just(b"Accept"), _b(["*/*", "text/event-stream", "application/json"])),
    st.tuples(st.just(b"Origin"), _b(["http://example.com", "null"])),
    st.tuples(st.just(b"Accept-Encoding"), _b(["gzip", "br, zstd", "*"])),
    st.tuples(st.just(b"X-Fuzz"), st.binary(max_size=30).map(lambda b: b.hex().encode())),
)
noise_header = st.one_of(
    st.tuples(st.just(b"X-Fuzz"), st.binary(max_size=30)),
    st.tuples(st.just(b"Accept"), _b(["*/*", "text/event-stream", "application/json"])),
    st.tuples(st.just(b"Origin"), _b(["http://example.com", "null", "\u00e9"])),
    st.tuples(st.just(b"Expect"), _b(["100-continue"])),
    st.tuples(st.just(b"Accept-Encoding"), _b(["gzip", "br, zstd", "*"])),
    st.tuples(st.just(b"Authorization"), _b(["Bearer x", "Basic Og==", ""])),
    st.tuples(st.just(b"Cookie"), _b(["a=b", "sessionid=x; csrftoken=y"])),
    st.tuples(st.just(b"Range"), _b(["bytes=0-1", "bytes=-1"])),
    st.tuples(st.just(b"Host"), _b(["127.0.0.1", "evil.example", "", "[::1]:1"])),
    st.tuples(st.just(b"If-None-Match"), if_none_match),
    st.tuples(st.just(b"Stream-Closed"), closed),
    st.tuples(st.just(b"Content-Type"), content_type),
)


def header_set(
    options: dict[bytes, st.SearchStrategy[bytes]], *, clean: bool = False
) -> st.SearchStrategy[list[Header]]:
    """Some of ``options`` (each maybe twice: a duplicate header), plus maybe noise; ``clean``
    sets draw no duplicates and only noise that changes nothing."""

    @st.composite
    def build(draw: st.DrawFn) -> list[Header]:
        headers: list[Header] = []
        for name, values in options.items():
            if draw(st.booleans()):
                headers.append((name, draw(values)))
                if not clean and draw(st.integers(min_value=0, max_value=12)) == 0:
                    headers.append((name, draw(values)))  # duplicated
        headers += draw(st.lists(benign_noise_header if clean else noise_header, max_size=2))
        order = draw(st.permutations(range(len(headers))))
        return [headers[i] for i in order]

    return build()


# -- bodies ------------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
    ),
    max_leaves=12,
)


def _encoded(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


TRICKY_JSON = [
    b"1e400", b"-1e999", b"[1e308, 2e308]", b"9" * 400, b'"\\ud800"', b'["\\udc00\\ud800", 1]',
    b'{"a": "\\ud83d\\ude00"}', b"NaN", b"[Infinity]", b"-0", b"0.0000000000000000000001",
    b"[]", b"[[]]", b"{}", b"\xef\xbb\xbf[1]", b"[1,]", b"{ invalid }", b"\xff\xfe", b"",
    b"   ", b'{"a":1} trailing', b"[1] [2]", b'"\x00"', b'"\\u0000"', b"null", b"true",
    b'"\xed\xa0\x80"', b"[" * 50 + b"]" * 50, b"[" * 5000 + b"]" * 5000, b"[" * 100_000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000, b"\t\r\n[1]\n",
]  # fmt: skip

valid_json_body = st.one_of(
    json_values.map(_encoded),
    st.lists(json_values, min_size=1, max_size=6).map(_encoded),
)
json_body = st.one_of(
    json_values.map(_encoded),
    st.lists(json_values, min_size=1, max_size=6).map(_encoded),
    st.sampled_from(TRICKY_JSON),
    st.integers(min_value=1000, max_value=12_000).map(lambda n: _encoded(list(range(n)))),
    json_values.map(lambda v: _encoded(v)[:-1] if len(_encoded(v)) > 1 else b"{"),
)
raw_body = st.one_of(
    st.binary(min_size=1, max_size=200),
    st.text(min_size=1, max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"\x00", b"\r\n\r\n", b"data: x\n\n", b"line\rline", b" lead", b"\xff"]),
    st.integers(min_value=100_000, max_value=140_000).map(lambda n: b"b" * n),
)
any_body = st.one_of(st.none(), st.just(b""), json_body, raw_body)


# -- paths -------------------------------------------------------------------------------------


def encodings(name: str) -> st.SearchStrategy[str]:
    """URL spellings of one stream path: minimal, every byte percent-encoded (upper or lower
    hex, '/' too), or a mix."""

    def every(lower: bool, keep_slash: bool) -> str:
        out = []
        for byte in name.encode("utf-8"):
            if keep_slash and byte == 0x2F:
                out.append("/")
            else:
                out.append(f"%{byte:02x}" if lower else f"%{byte:02X}")
        return "".join(out)

    return st.one_of(
        st.just(quote(name, safe="/")),
        st.just(quote(name, safe="/")),
        st.builds(every, st.booleans(), st.booleans()),
    )


BAD_STREAM_SUFFIXES = [
    "a/%2e%2e/b", "%2E%2E", "a/%2e/b", "a/../b", "./a", "a%00b", "%00", "%ff%fe", "a//b", "a/",
    "", "__ds/x", "__ds/yjs/s/docs/d", "a%0d%0aSet-Cookie:x", "x" * 1025, "\u00e9" * 600,
    "a\tb", "a b", "..%2f..%2fetc",
]  # fmt: skip
# Odd but valid spellings (a literal '%', a query, a fragment): other streams, never a 5xx.
ODD_STREAM_SUFFIXES = ["%", "%zz", "a%2", "odd?b=c", "%3f", "odd#frag", "%25%32%65"]
