"""Fuzzing the subscription control APIs under ``/v1/stream/__ds/`` (PROTOCOL.md 6, 7).

Requests of every method to every kind of control URL (a subscription, its streams, one of its
streams, claim, ack, release, callback, the JWKS, and paths that are none of these), with ids
valid and not, configurations built from valid fields mutated one by one (types, patterns with
wildcards in the wrong places, NUL and control characters, explicit streams under ``__ds``,
webhook URLs to every address class, leases out of range and of the wrong JSON type), garbage
bodies and wake tokens that are not the server's.

Invariants, besides no 5xx and no hang: a PUT refused to a fresh id creates nothing (its GET is
404), and a sentinel subscription nobody addresses is unchanged after every request.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import strategies as s
from tests.fuzz.support import RawHttp, examples, fuzz_settings

JSON = [(b"Content-Type", b"application/json")]
CONTROL = "/v1/stream/__ds"
SENTINEL = f"fuzz-sentinel-{uuid.uuid4().hex[:8]}"
WAKE_STREAM = "fuzz-subs/wake"

IDS = st.one_of(
    st.just("fresh"),  # replaced by a new valid id (half of the draws)
    st.just("fresh"),
    st.just("fresh"),
    st.just("fresh"),
    st.text(alphabet="abcXYZ019._~-", min_size=1, max_size=12),
    st.text(max_size=20).map(lambda t: quote(t, safe="")),
    st.binary(max_size=12).map(lambda b: quote(b, safe="")),
    st.sampled_from(["", ".", "..", "%00", "a" * 129, "a" * 5000, "%2F", "x%20y", "__ds", "jwks"]),
)
PATHS = st.sampled_from([
    "fuzz-subs/a", "fuzz-subs/a/b", "fuzz-subs", "a/../b", "__ds/x", "a//b", "a\x00b", "",
    "/fuzz-subs/lead", "fuzz-subs/trail/", "é/ü", "x" * 5000, ".", "..",
])  # fmt: skip
PATTERNS = st.one_of(
    st.sampled_from([
        "fuzz-subs/*", "fuzz-subs/**", "**", "*", "*/x", "**/x", "fuzz-subs/*/c", "a*", "*b",
        "a/**b", "__ds/**", "a//b", "", "/", "a/../b", "a\x00b", "a\nb", "**/**/**", "x" * 2000,
    ]),
    st.text(alphabet="ab*/.\\[]()?+^$", max_size=30),
)  # fmt: skip
URLS = st.sampled_from([
    "https://93.184.216.34/hook", "http://93.184.216.34/hook", "https://127.0.0.1/h",
    "https://[::1]/h", "https://10.0.0.1/h", "https://169.254.169.254/latest",
    "https://[::ffff:10.0.0.1]/h", "https://100.64.0.1/h", "https://0.0.0.0/h",
    "https://224.0.0.1/h", "https://[fd00::1]/h", "https://[fe80::1]/h", "https://0x7f000001/h",
    "https://2130706433/h", "ftp://93.184.216.34/h", "https://93.184.216.34:99999/h",
    "https://user:pass@93.184.216.34/h", "not a url", "", "https://", "https://a b/h",
    "https://93.184.216.34/" + "p" * 5000, "javascript:alert(1)", "https://localhost/h",
])  # fmt: skip
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def configs(draw: st.DrawFn) -> Any:
    """A subscription configuration: valid fields, some replaced by something else (or, one
    time in three, a valid one, so that creations and their links are fuzzed too)."""
    kind = draw(st.sampled_from(["webhook", "pull-wake"]))
    if draw(st.integers(0, 2)) == 0:
        pattern = draw(
            st.sampled_from(["fuzz-subs/*", "fuzz-subs/**", "**", "*/x", "fuzz-subs/*/c"])
        )
        if kind == "webhook":
            return {"type": kind, "pattern": pattern, "webhook": {"url": "https://93.184.216.34/h"}}
        return {"type": kind, "pattern": pattern, "wake_stream": WAKE_STREAM}
    config: dict[str, Any] = {"type": kind}
    if draw(st.booleans()):
        config["pattern"] = draw(PATTERNS)
    if draw(st.booleans()):
        config["streams"] = draw(st.lists(PATHS, max_size=4))
    if kind == "webhook" or draw(st.booleans()):
        config["webhook"] = {"url": draw(URLS)}
    if kind == "pull-wake" or draw(st.booleans()):
        config["wake_stream"] = draw(st.one_of(st.just(WAKE_STREAM), PATHS))
    if draw(st.booleans()):
        config["lease_ttl_ms"] = draw(
            st.sampled_from([999, 1000, 30000, 600000, 600001, 0, -1, 2**63, 1.5, "30000", True])
        )
    if draw(st.booleans()):
        config["description"] = draw(st.sampled_from(["d", "", "\x00", "é" * 3000, 5, None]))
    for _ in range(draw(st.integers(0, 2))):
        config[draw(st.sampled_from([*config, "extra"]))] = draw(JSON_VALUES)
    return config


@st.composite
def bodies(draw: st.DrawFn) -> bytes | None:
    choice = draw(st.integers(0, 9))
    if choice <= 4:
        return json.dumps(draw(configs())).encode()
    if choice == 5:
        acks = draw(
            st.lists(
                st.fixed_dictionaries({"stream": PATHS, "offset": st.text(max_size=40)}), max_size=3
            )
        )
        return json.dumps({
            "wake_id": draw(st.text(max_size=10)), "generation": draw(JSON_VALUES),
            "acks": acks, "done": draw(JSON_VALUES), "worker": draw(JSON_VALUES),
        }).encode()  # fmt: skip
    if choice == 6:
        return json.dumps({"streams": draw(st.lists(PATHS | JSON_VALUES, max_size=4))}).encode()
    if choice == 7:
        return draw(st.binary(max_size=200))
    if choice == 8:
        depth = draw(st.integers(1, 100_000))
        return b"[" * depth + b"]" * draw(st.integers(0, depth))
    return None


SUFFIXES = st.sampled_from([
    "", "", "", "", "/streams", "/streams/fuzz-subs/a", "/streams/%ff%fe", "/streams/",
    "/claim", "/ack", "/release", "/callback", "/other", "/claim/x",
])  # fmt: skip


@pytest.fixture(scope="module")
def subs_http(fuzz_server: Any, pg: Any) -> Iterator[RawHttp]:
    """The fuzz server's HTTP, with a sentinel subscription; afterwards no subscription the
    fuzzing made is left (the tests after it share the database, and one left with a pattern
    such as ``**`` would follow every stream they make)."""
    (before,) = pg.execute("SELECT coalesce(max(id), 0) FROM ds_subscription").fetchone()
    http = RawHttp(fuzz_server.port)
    created = http.send("PUT", f"/v1/stream/{WAKE_STREAM}", JSON, b"", check=True)
    assert created.status in (200, 201), created.body
    sentinel = {"type": "pull-wake", "pattern": "fuzz-subs/sentinel/*", "wake_stream": WAKE_STREAM}
    made = http.send(
        "PUT",
        f"{CONTROL}/subscriptions/{SENTINEL}",
        JSON,
        json.dumps(sentinel).encode(),
        check=True,
    )
    assert made.status == 201, made.body
    yield http
    http.send("DELETE", f"{CONTROL}/subscriptions/{SENTINEL}", check=True)
    left = [
        row[0]
        for row in pg.execute(
            "SELECT subscription_id FROM ds_subscription WHERE id > %s", [before]
        ).fetchall()
    ]
    for sub_id in left:
        http.send("DELETE", f"{CONTROL}/subscriptions/{quote(sub_id, safe='')}", check=True)
    http.close()
    assert not left, f"the fuzzing left subscriptions behind: {left}"


def sentinel_state(http: RawHttp) -> bytes:
    reply = http.send("GET", f"{CONTROL}/subscriptions/{SENTINEL}", check=True)
    assert reply.status == 200, reply.body
    return reply.body


@fuzz_settings(max_examples=examples(200))
@given(
    method=st.sampled_from(
        ["PUT", "PUT", "POST", "POST", "GET", "DELETE", "HEAD", "PATCH", "OPTIONS"]
    ),
    sub_id=IDS,
    suffix=SUFFIXES,
    body=bodies(),
    token=st.one_of(st.none(), st.text(max_size=60), st.just("a.b.c")),
    noise=s.header_set({b"Content-Type": s.content_type}),
)
def test_control_api_fuzz(
    subs_http: RawHttp,
    method: str,
    sub_id: str,
    suffix: str,
    body: bytes | None,
    token: str | None,
    noise: list[tuple[bytes, bytes]],
) -> None:
    http = subs_http
    fresh = sub_id == "fresh"
    if fresh:
        sub_id = f"fuzz-{uuid.uuid4().hex[:12]}"
    if sub_id == SENTINEL:
        sub_id += "-other"
    if sub_id == "__ds":
        target = f"{CONTROL}/{suffix}"
    elif sub_id == "jwks":
        target = f"{CONTROL}/jwks.json{suffix}"
    else:
        target = f"{CONTROL}/subscriptions/{sub_id}{suffix}"
    before = sentinel_state(http)
    headers = [h for h in noise if h[0].lower() not in (b"host", b"authorization")]
    if not any(name.lower() == b"content-type" for name, _ in headers):
        headers += JSON
    if token is not None:
        headers.append((b"Authorization", b"Bearer " + token.encode("utf-8", "replace")))
    reply = http.send(method, target, headers, body)
    if fresh and method == "PUT" and suffix == "" and reply.status >= 400:
        after = http.send("GET", f"{CONTROL}/subscriptions/{sub_id}", check=True)
        assert after.status == 404, (
            f"a refused PUT ({reply.status}) created {sub_id}: {after.body!r}"
        )
    if method == "PUT" and suffix == "" and reply.status in (200, 201):
        # Made (or replaced) by this request, whatever its id: gone before the next one.
        gone = http.send("DELETE", target, check=True)
        assert gone.status == 204, (target, gone.status, gone.body)
    assert sentinel_state(http) == before, f"{method} {target} changed the sentinel subscription"
