"""Subscription management through the real server (PROTOCOL.md 6): create and re-confirm by
configuration hash, read, delete, glob and explicit links, backfill at the tail, streams
created later linked before their first append, the reserved ``__ds`` prefix, and bad input
answered 4xx without changing anything."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from subscriptions.protocol import glob_matches
from tests.conftest import ServerProcess
from tests.subscriptions.support import (
    CONTROL,
    Receiver,
    acked,
    get_subscription,
    put_subscription,
)

ZERO = "0000000000000000_0000000000000000"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    hook = Receiver(lambda received: (200, {"done": True}))
    yield hook
    hook.close()


@pytest.fixture
def prefix() -> str:
    return f"mgmt{time.time_ns()}"


def webhook(receiver: Receiver, **config: Any) -> dict[str, Any]:
    return {"type": "webhook", "webhook": {"url": receiver.url}} | config


def test_create_reconfirm_conflict_get_delete(
    client: httpx.Client, receiver: Receiver, prefix: str
) -> None:
    """PROTOCOL.md 6.2, 6.3: 201, then 200 for the same normalized configuration (streams in
    another order, repeated), 409 for another; GET shows it without any secret; DELETE 204,
    then 404, and DELETE again 204."""
    sub = f"{prefix}-sub"
    config = webhook(
        receiver, pattern=f"{prefix}/*", streams=[f"{prefix}/b", f"{prefix}/a"], description="d"
    )
    created = put_subscription(client, sub, **config)
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["id"] == body["subscription_id"] == sub
    assert body["type"] == "webhook" and body["pattern"] == f"{prefix}/*"
    assert body["lease_ttl_ms"] == 30_000 and body["status"] == "active"
    assert body["webhook"]["url"] == receiver.url
    assert body["webhook"]["signing"]["alg"] == "ed25519"
    assert body["webhook"]["signing"]["jwks_url"] == f"{client.base_url}{CONTROL}/jwks.json"
    assert body["created_at"].endswith("Z")
    assert "secret" not in created.text
    assert {(s["path"], s["link_type"]) for s in body["streams"]} == {
        (f"{prefix}/a", "explicit"),
        (f"{prefix}/b", "explicit"),
    }
    again = dict(config, streams=[f"{prefix}/a", f"{prefix}/b", f"{prefix}/a"])
    assert put_subscription(client, sub, **again).status_code == 200
    assert put_subscription(client, sub, **dict(config, lease_ttl_ms=30_000)).status_code == 200
    other = put_subscription(client, sub, **dict(config, description="other"))
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "SUBSCRIPTION_ALREADY_EXISTS"
    assert get_subscription(client, sub)["description"] == "d"

    assert client.delete(f"{CONTROL}/subscriptions/{sub}").status_code == 204
    missing = client.get(f"{CONTROL}/subscriptions/{sub}")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "SUBSCRIPTION_NOT_FOUND"
    assert client.delete(f"{CONTROL}/subscriptions/{sub}").status_code == 204


def test_globs_backfill_at_the_tail_and_link_new_streams_from_their_start(
    client: httpx.Client, receiver: Receiver, prefix: str
) -> None:
    """PROTOCOL.md 6.2: ``*`` is one segment, ``**`` any number; existing matches are linked
    at their tail (no replay), a stream created later from its start, so its first append
    (the create's body) wakes the subscription."""
    for path in ("a/x", "a/y/z", "b/x"):
        client.put(
            f"/v1/stream/{prefix}/{path}", content=b"old", headers={"Content-Type": "text/plain"}
        )
    one = f"{prefix}-one"
    anywhere = f"{prefix}-any"
    assert (
        put_subscription(client, one, **webhook(receiver, pattern=f"{prefix}/a/*")).status_code
        == 201
    )
    assert (
        put_subscription(client, anywhere, **webhook(receiver, pattern=f"{prefix}/**")).status_code
        == 201
    )
    tail = client.head(f"/v1/stream/{prefix}/a/x").headers["Stream-Next-Offset"]
    assert acked(client, one) == {f"{prefix}/a/x": tail}
    assert set(acked(client, anywhere)) == {f"{prefix}/a/x", f"{prefix}/a/y/z", f"{prefix}/b/x"}

    created = client.put(
        f"/v1/stream/{prefix}/a/new", content=b"first", headers={"Content-Type": "text/plain"}
    )
    new_tail = created.headers["Stream-Next-Offset"]
    got = receiver.wait_for(
        lambda got: any(
            r.subscription_id == one
            and any(s["path"] == f"{prefix}/a/new" for s in r.body["streams"])
            for r in got
        )
    )
    wake = next(r for r in got if r.subscription_id == one)
    assert wake.stream(f"{prefix}/a/new") == {
        "path": f"{prefix}/a/new",
        "link_type": "glob",
        "acked_offset": ZERO,
        "tail_offset": new_tail,
        "has_pending": True,
    }
    assert wake.stream(f"{prefix}/a/x")["has_pending"] is False


def test_appends_look_for_subscriptions_only_while_one_may_follow_the_stream(
    client: httpx.Client, receiver: Receiver, prefix: str, pg: Any
) -> None:
    """An append to a stream no subscription follows marks it not followed (ds_stream.followed)
    and the appends after it skip the lookup of subscriptions; a link added, explicit or by a
    pattern's backfill, marks it followed again, and its next append notifies the
    subscription."""
    text = {"Content-Type": "text/plain"}

    def followed(path: str) -> bool:
        row = pg.execute("SELECT followed FROM ds_stream WHERE path = %s", [path]).fetchone()
        return bool(row[0])

    def notified(listener: psycopg.Connection[Any], sub: str) -> bool:
        (sid,) = pg.execute(
            "SELECT id FROM ds_subscription WHERE subscription_id = %s", [sub]
        ).fetchone()
        return any(
            n.payload.startswith("sub:") and str(sid) in n.payload[4:].split(",")
            for n in listener.notifies(timeout=1, stop_after=5)
        )

    quiet = f"{prefix}/quiet"
    assert client.put(f"/v1/stream/{quiet}", headers=text).status_code == 201
    assert followed(quiet)  # until an append finds out
    for _ in range(2):
        assert client.post(f"/v1/stream/{quiet}", content=b"a", headers=text).status_code == 204
        assert not followed(quiet)

    explicit = f"{prefix}-followed"
    assert (
        put_subscription(client, explicit, **webhook(receiver, streams=[quiet])).status_code == 201
    )
    assert followed(quiet)
    with psycopg.connect(pg.info.dsn, autocommit=True) as listener:
        listener.execute("LISTEN ds_streams")
        assert client.post(f"/v1/stream/{quiet}", content=b"b", headers=text).status_code == 204
        assert notified(listener, explicit)
    assert followed(quiet)

    globbed = f"{prefix}/globbed/x"
    client.put(f"/v1/stream/{globbed}", content=b"a", headers=text)
    assert client.post(f"/v1/stream/{globbed}", content=b"b", headers=text).status_code == 204
    assert not followed(globbed)
    pattern = f"{prefix}-pattern"
    created = put_subscription(client, pattern, **webhook(receiver, pattern=f"{prefix}/globbed/*"))
    assert created.status_code == 201
    assert followed(globbed)


# Stream paths under the test's prefix (the prefix itself is ""), each created as a stream.
SHAPE_PATHS = ("", "a", "a/c", "ab/c", "a/b", "a/b/c", "a/x/c", "x/c", "a/b/c/d", "leaf", "a/leaf")


@pytest.mark.parametrize("streams_first", [True, False], ids=["backfilled", "created-later"])
def test_patterns_of_every_prefix_shape_link_exactly_their_matches(
    client: httpx.Client, receiver: Receiver, prefix: str, streams_first: bool
) -> None:
    """PROTOCOL.md 6.2: whatever the pattern's literal beginning (none, whole segments, the
    whole path; ``**`` standing for no segment at all, so ``p/a/**`` matches ``p/a``), a
    subscription follows exactly the streams the glob matches, whether they existed before it
    (the backfill) or were created after it (the trigger, which finds candidates by prefix)."""
    leaf = f"{prefix}-leaf"
    paths = [f"{prefix}/{p}".rstrip("/").replace("leaf", leaf) for p in SHAPE_PATHS] + [leaf]
    patterns = {
        "mid-star": f"{prefix}/a/*/c",
        "tail-globstar": f"{prefix}/a/**",
        "root-globstar": f"{prefix}/**",
        "root-star": f"{prefix}/*",
        "inner-globstar": f"{prefix}/**/c",
        "exact": f"{prefix}/a/c",
        "leading-star": f"*/{leaf}",
        "leading-globstar": f"**/{leaf}",
    }

    def create_streams() -> None:
        for path in paths:
            created = client.put(f"/v1/stream/{path}", headers={"Content-Type": "text/plain"})
            assert created.status_code == 201, (path, created.text)

    if streams_first:
        create_streams()
    subs = {name: f"{prefix}-{name}" for name in [*patterns, "explicit"]}
    try:
        for name, pattern in patterns.items():
            made = put_subscription(client, subs[name], **webhook(receiver, pattern=pattern))
            assert made.status_code == 201, made.text
        explicit = [f"{prefix}/a/c", f"{prefix}/missing"]
        made = put_subscription(client, subs["explicit"], **webhook(receiver, streams=explicit))
        assert made.status_code == 201, made.text
        if not streams_first:
            create_streams()
        for name, pattern in patterns.items():
            expected = {path for path in paths if glob_matches(pattern, path)}
            assert expected, name
            assert set(acked(client, subs[name])) == expected, name
        assert set(acked(client, subs["explicit"])) == set(explicit)
    finally:
        for sub in subs.values():
            client.delete(f"{CONTROL}/subscriptions/{sub}")


def test_explicit_links_added_and_removed_keep_glob_links(
    client: httpx.Client, receiver: Receiver, prefix: str
) -> None:
    """PROTOCOL.md 6.1, 6.4: added explicit links start at the tail (zero for a stream that
    does not exist yet); adding twice is idempotent; removing an explicit link leaves a
    matching glob link; explicit wins in responses."""
    client.put(f"/v1/stream/{prefix}/g/one", content=b"abc", headers={"Content-Type": "text/plain"})
    sub = f"{prefix}-explicit"
    assert (
        put_subscription(client, sub, **webhook(receiver, pattern=f"{prefix}/g/*")).status_code
        == 201
    )
    url = f"{CONTROL}/subscriptions/{sub}/streams"
    for _ in range(2):
        added = client.post(url, json={"streams": [f"{prefix}/g/one", f"{prefix}/elsewhere"]})
        assert added.status_code == 204, added.text
    streams = {s["path"]: s for s in get_subscription(client, sub)["streams"]}
    assert streams[f"{prefix}/g/one"]["link_type"] == "explicit"
    assert streams[f"{prefix}/elsewhere"] == {
        "path": f"{prefix}/elsewhere",
        "link_type": "explicit",
        "acked_offset": ZERO,
    }
    for path in (f"{prefix}/g/one", f"{prefix}/elsewhere", f"{prefix}/never-linked"):
        removed = client.delete(f"{url}/{httpx.URL(path).raw_path.decode().replace('/', '%2F')}")
        assert removed.status_code == 204
    streams = {s["path"]: s for s in get_subscription(client, sub)["streams"]}
    assert set(streams) == {f"{prefix}/g/one"}
    assert streams[f"{prefix}/g/one"]["link_type"] == "glob"


def test_deleted_streams_lose_glob_links_and_explicit_links_restart(
    client: httpx.Client, receiver: Receiver, prefix: str
) -> None:
    """A deleted stream's glob link goes; an explicit link stays, back at offset zero, so a
    stream created again at the path is followed from its start."""
    for name in ("globbed", "named"):
        client.put(
            f"/v1/stream/{prefix}/{name}", content=b"x", headers={"Content-Type": "text/plain"}
        )
    sub = f"{prefix}-deletes"
    config = webhook(receiver, pattern=f"{prefix}/globbed", streams=[f"{prefix}/named"])
    assert put_subscription(client, sub, **config).status_code == 201
    for name in ("globbed", "named"):
        assert client.delete(f"/v1/stream/{prefix}/{name}").status_code == 204
    assert acked(client, sub) == {f"{prefix}/named": ZERO}


def test_control_prefix_is_reserved(client: httpx.Client) -> None:
    """PROTOCOL.md 6: ``__ds`` is routed before streams and is not a stream path."""
    assert client.put("/v1/stream/__ds", headers={"Content-Type": "text/plain"}).status_code == 400
    created = client.put("/v1/stream/__ds/events/x", headers={"Content-Type": "text/plain"})
    assert created.status_code == 404
    assert created.json()["error"]["code"] == "NOT_FOUND"
    assert client.post("/v1/stream/__ds/subscriptions/x/unknown").status_code == 404
    wrong = client.patch(f"{CONTROL}/subscriptions/x")
    assert wrong.status_code == 405 and "PUT" in wrong.headers["Allow"]
    assert client.post(f"{CONTROL}/jwks.json").status_code == 405


def pull(**config: Any) -> dict[str, Any]:
    return {"type": "pull-wake", "wake_stream": "w"} | config


BAD_CONFIGS: list[tuple[str, Any]] = [
    ("not json", b"{"),
    ("not an object", b"[]"),
    ("unknown type", {"type": "email", "pattern": "a/*"}),
    ("no pattern nor streams", {"type": "webhook", "webhook": {"url": "http://127.0.0.1:9/h"}}),
    ("no webhook url", {"type": "webhook", "pattern": "a/*"}),
    ("webhook url not text", {"type": "webhook", "pattern": "a/*", "webhook": {"url": 7}}),
    ("no wake stream", {"type": "pull-wake", "pattern": "a/*"}),
    ("lease too short", pull(pattern="a/*", lease_ttl_ms=999)),
    ("lease too long", pull(pattern="a/*", lease_ttl_ms=600_001)),
    ("lease as text", pull(pattern="a/*", lease_ttl_ms="30000")),
    ("lease as boolean", pull(pattern="a/*", lease_ttl_ms=True)),
    ("star inside a segment", pull(pattern="a/b*")),
    ("dot-dot segment", pull(pattern="a/../b")),
    ("reserved pattern", pull(pattern="__ds/**")),
    ("streams not a list", pull(streams="a")),
    ("stream not text", pull(streams=[1])),
    ("lone surrogate", pull(streams=["a\ud800"])),
    ("control character", pull(streams=["a\u0001b"])),
    ("wake stream followed", pull(streams=["w"])),
    ("description not text", pull(streams=["a"], description=5)),
    ("too many streams", pull(streams=[f"s{i}" for i in range(1001)])),
]


@pytest.mark.parametrize(("case", "config"), BAD_CONFIGS, ids=[c for c, _ in BAD_CONFIGS])
def test_bad_configurations_are_400_and_create_nothing(
    client: httpx.Client, prefix: str, case: str, config: Any
) -> None:
    url = f"{CONTROL}/subscriptions/{prefix}-bad"
    # json.dumps escapes what UTF-8 cannot carry (a lone surrogate) as JSON allows.
    body = config if isinstance(config, bytes) else json.dumps(config).encode()
    response = client.put(url, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "INVALID_REQUEST"
    assert client.get(url).status_code == 404


@pytest.mark.parametrize(
    "sub_id", ["", "-starts-with-dash", "x" * 129, "has space", "caf%C3%A9", "a%2Fb"]
)
def test_bad_subscription_ids_are_refused(client: httpx.Client, sub_id: str) -> None:
    response = client.put(
        f"{CONTROL}/subscriptions/{sub_id}", json={"type": "pull-wake", "streams": ["a"],
                                                   "wake_stream": "w"}
    )  # fmt: skip
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["code"] in ("INVALID_REQUEST", "NOT_FOUND")


def test_membership_changes_of_a_missing_subscription_are_404(
    client: httpx.Client, prefix: str
) -> None:
    base = f"{CONTROL}/subscriptions/{prefix}-missing"
    assert client.post(f"{base}/streams", json={"streams": ["a"]}).status_code == 404
    assert client.delete(f"{base}/streams/a").status_code == 404
    assert client.post(f"{base}/streams", json={"streams": []}).status_code == 400
    assert client.post(f"{base}/claim", json={"worker": "w"}).status_code == 404


def test_streams_created_while_pattern_subscriptions_come_and_go_are_created(
    server: ServerProcess,
) -> None:
    """A stream's creation links it to the pattern subscriptions it matches, in its trigger,
    while a subscription may be deleted at the same moment: the link's insert then named a
    subscription gone, and the create answered 500 (40 of 480 in a soak probe). Creates racing
    two loops that create and delete subscriptions over their paths must all succeed."""
    prefix = f"race-{time.time_ns()}"
    stop = threading.Event()
    statuses: list[int] = []

    def churn(worker: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            while not stop.is_set():
                sub = f"{prefix}-sub-{worker}"
                config = {"type": "pull-wake", "pattern": f"{prefix}/*",
                          "wake_stream": f"{prefix}-wake-{worker}"}  # fmt: skip
                assert put_subscription(http, sub, **config).status_code in (200, 201)
                assert http.delete(f"{CONTROL}/subscriptions/{sub}").status_code in (200, 204)

    def create(worker: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            for i in range(60):
                path = f"/v1/stream/{prefix}/k-{worker}-{i}"
                statuses.append(http.put(path, headers=JSON).status_code)

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for worker in range(2):
            http.put(f"/v1/stream/{prefix}-wake-{worker}", headers=JSON)
    churners = [threading.Thread(target=churn, args=(w,)) for w in range(2)]
    creators = [threading.Thread(target=create, args=(w,)) for w in range(4)]
    for thread in churners + creators:
        thread.start()
    for thread in creators:
        thread.join()
    stop.set()
    for thread in churners:
        thread.join()
    assert sorted(set(statuses)) == [201], {s: statuses.count(s) for s in set(statuses)}
