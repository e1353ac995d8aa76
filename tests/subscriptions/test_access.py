"""Access control of subscriptions (PROTOCOL.md 12.1, 12.9) on a server in ``keys`` mode: a
subscription is the resource ``stream/__ds/subscriptions/<id>``; managing it needs ``manage``,
reading it ``read``, claiming ``append``; its creator must be allowed to read what it follows
and to append to its wake stream; callbacks and acks need the wake's token, and only that."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from tests.access.support import bearer, create_key, key_id
from tests.conftest import manage
from tests.subscriptions.support import CONTROL, Receiver, report, wait_until

SUBS = "stream/__ds/subscriptions/"


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(env={"DS_AUTH__MODE": "keys"})


@pytest.fixture(scope="module")
def keys(server: Any, database_url: str) -> dict[str, dict[str, str]]:
    made = {
        "ops": create_key(database_url, "sub-ops", f"{SUBS}:read,append,manage",
                          "stream/acl-subs/:read,append,manage"),
        "manager-blind": create_key(database_url, "sub-blind", f"{SUBS}:manage"),
        "no-wake-append": create_key(database_url, "sub-nowake", f"{SUBS}:manage",
                                     "stream/acl-subs/:read"),
        "reader": create_key(database_url, "sub-reader", f"{SUBS}:read"),
        "worker": create_key(database_url, "sub-worker", f"{SUBS}acl-:append"),
        "elsewhere": create_key(database_url, "sub-else", f"{SUBS}other-:read,append,manage",
                                "stream/acl-subs/:read,append"),
    }  # fmt: skip
    return {name: bearer(key) for name, key in made.items()}


@pytest.fixture
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def test_management_needs_its_grants(http: httpx.Client, keys: dict[str, dict[str, str]]) -> None:
    sub = f"acl-{time.time_ns()}"
    url = f"{CONTROL}/subscriptions/{sub}"
    pull = {"type": "pull-wake", "pattern": "acl-subs/events/*", "wake_stream": "acl-subs/wake"}
    refused = [
        (None, 401),
        (keys["reader"], 403),  # no manage
        (keys["manager-blind"], 403),  # may not read the streams it would follow
        (keys["no-wake-append"], 403),  # may not append to the wake stream
        (keys["elsewhere"], 403),  # another subscription prefix
    ]
    for headers, status in refused:
        response = http.put(url, json=pull, headers=headers)
        assert response.status_code == status, (headers, response.text)
        assert response.headers["Content-Type"] == "application/json"
    assert http.get(url, headers=keys["ops"]).status_code == 404  # nothing was created
    assert http.put(url, json=pull, headers=keys["ops"]).status_code == 201
    assert http.get(url).status_code == 401
    assert http.get(url, headers=keys["reader"]).status_code == 200
    add = http.post(f"{url}/streams", json={"streams": ["acl-subs/x"]}, headers=keys["reader"])
    assert add.status_code == 403
    add = http.post(f"{url}/streams", json={"streams": ["private/x"]}, headers=keys["ops"])
    assert add.status_code == 403  # may not read it
    assert http.delete(url, headers=keys["reader"]).status_code == 403
    assert http.get(url, headers=keys["reader"]).status_code == 200
    assert http.delete(url, headers=keys["ops"]).status_code == 204


def test_a_pattern_needs_read_on_every_stream_it_can_match(
    http: httpx.Client, keys: dict[str, dict[str, str]]
) -> None:
    """``acl-subs/**`` also matches the stream ``acl-subs`` itself (``**`` may stand for no
    segment): a key that may read only below ``acl-subs/`` may not subscribe to it, since its
    wakes would name that stream and its offsets; ``acl-subs/*/**`` cannot match it."""
    url = f"{CONTROL}/subscriptions/acl-{time.time_ns()}"
    pull = {"type": "pull-wake", "pattern": "acl-subs/**", "wake_stream": "acl-subs/wake"}
    refused = http.put(url, json=pull, headers=keys["ops"])
    assert refused.status_code == 403, refused.text
    assert "may not read stream/acl-subs" in refused.text
    narrower = {**pull, "pattern": "acl-subs/*/**"}
    assert http.put(url, json=narrower, headers=keys["ops"]).status_code == 201
    assert http.delete(url, headers=keys["ops"]).status_code == 204


def test_claims_need_append_and_acks_need_the_claim_token(
    http: httpx.Client, keys: dict[str, dict[str, str]]
) -> None:
    sub = f"acl-{time.time_ns()}"
    url = f"{CONTROL}/subscriptions/{sub}"
    pull = {"type": "pull-wake", "streams": ["acl-subs/claimed"], "wake_stream": "acl-subs/wake"}
    assert http.put(url, json=pull, headers=keys["ops"]).status_code == 201
    http.put("/v1/stream/acl-subs/claimed", content=b"x",
             headers={"Content-Type": "text/plain"} | keys["ops"])  # fmt: skip
    assert http.post(f"{url}/claim", json={"worker": "w"}).status_code == 401
    assert (
        http.post(f"{url}/claim", json={"worker": "w"}, headers=keys["reader"]).status_code == 403
    )
    claimed = http.post(f"{url}/claim", json={"worker": "w"}, headers=keys["worker"])
    assert claimed.status_code == 200, claimed.text
    token, wake_id, generation = (claimed.json()[k] for k in ("token", "wake_id", "generation"))
    # An API key is not a claim token; the claim token needs no API key besides.
    key = keys["ops"]["Authorization"].removeprefix("Bearer ")
    assert report(http, sub, "ack", key, wake_id, generation).status_code == 401
    assert report(http, sub, "ack", token, wake_id, generation).status_code == 200


def test_webhook_callbacks_work_with_their_token_alone(
    http: httpx.Client, keys: dict[str, dict[str, str]]
) -> None:
    receiver = Receiver()
    try:
        sub = f"acl-{time.time_ns()}"
        config = {"type": "webhook", "streams": ["acl-subs/hooked"],
                  "webhook": {"url": receiver.url}}  # fmt: skip
        assert http.put(f"{CONTROL}/subscriptions/{sub}", json=config,
                        headers=keys["ops"]).status_code == 201  # fmt: skip
        http.put("/v1/stream/acl-subs/hooked", content=b"x",
                 headers={"Content-Type": "text/plain"} | keys["ops"])  # fmt: skip
        (wake,) = receiver.wait(1)
        assert http.get(f"{CONTROL}/jwks.json").status_code == 200  # public, no key
        done = report(http, sub, "callback", wake.body["callback_token"], wake.body["wake_id"],
                      wake.generation)  # fmt: skip
        assert done.status_code == 200, done.text
    finally:
        receiver.close()


def test_a_revoked_keys_subscriptions_wake_nobody(
    http: httpx.Client, server: Any, database_url: str
) -> None:
    """A subscription made with a key went on sending webhooks after the key was revoked,
    naming every stream that changed to whoever held the URL. It is paused at its next wake
    now, saying why, and sends nothing more; a pull-wake worker's claim finds it paused."""
    owner = create_key(database_url, "sub-owner", f"{SUBS}revoked-:read,append,manage",
                       "stream/acl-revoke/:read,append,manage")  # fmt: skip
    writer = bearer(create_key(database_url, "sub-writer", "stream/acl-revoke/:append",
                               f"{SUBS}revoked-:append"))  # fmt: skip
    receiver = Receiver(answer=lambda received: (200, {"done": True}))
    try:
        hooked, pulled = f"revoked-{time.time_ns()}", f"revoked-pull-{time.time_ns()}"
        text = {"Content-Type": "text/plain"}
        for stream in ("wake", "pulled"):
            http.put(f"/v1/stream/acl-revoke/{stream}", headers=text | bearer(owner))
        configs = {
            hooked: {"type": "webhook", "streams": ["acl-revoke/hooked"],
                     "webhook": {"url": receiver.url}},
            pulled: {"type": "pull-wake", "streams": ["acl-revoke/pulled"],
                     "wake_stream": "acl-revoke/wake"},
        }  # fmt: skip
        for sub, config in configs.items():
            put = http.put(f"{CONTROL}/subscriptions/{sub}", json=config, headers=bearer(owner))
            assert put.status_code == 201, put.text
        http.put("/v1/stream/acl-revoke/hooked", content=b"x", headers=text | bearer(owner))
        receiver.wait(1)
        assert manage(database_url, "revoke_api_key", key_id(owner)).returncode == 0

        for stream in ("hooked", "pulled"):
            appended = http.post(f"/v1/stream/acl-revoke/{stream}", content=b"y",
                                 headers=text | writer)  # fmt: skip
            assert appended.status_code == 204, appended.text
        with psycopg.connect(database_url, autocommit=True) as conn:
            wait_until(
                lambda: (
                    conn.execute(
                        "SELECT paused AND last_error LIKE 'paused: the API key%%'"
                        " FROM ds_subscription WHERE subscription_id = %s",
                        (hooked,),
                    ).fetchone()
                    == (True,)
                )
            )
        claim = http.post(f"{CONTROL}/subscriptions/{pulled}/claim",
                          json={"worker": "w1"}, headers=writer)  # fmt: skip
        assert claim.status_code == 409 and "PAUSED" in claim.text, claim.text
        assert len(receiver.received) == 1  # the wake before the revocation, and no other

        # The application takes it over with a key that stands: the same configuration PUT
        # again (200) resumes it, and the append made meanwhile is woken (review: it stayed
        # paused for good).
        heir = bearer(create_key(database_url, "sub-heir", f"{SUBS}revoked-:read,append,manage",
                                 "stream/acl-revoke/:read,append,manage"))  # fmt: skip
        again = http.put(f"{CONTROL}/subscriptions/{hooked}", json=configs[hooked], headers=heir)
        assert again.status_code == 200, again.text
        woken = receiver.wait(2)[1]
        assert woken.subscription_id == hooked
        # An operator's pause stays, taken over or not (review: the PUT lifted it).
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("SELECT ds_sub_pause(id, true) FROM ds_subscription"
                         " WHERE subscription_id = %s", (pulled,))  # fmt: skip
            again = http.put(f"{CONTROL}/subscriptions/{pulled}", json=configs[pulled],
                             headers=heir)  # fmt: skip
            assert again.status_code == 200, again.text
            paused = conn.execute("SELECT paused FROM ds_subscription WHERE subscription_id = %s",
                                  (pulled,)).fetchone()  # fmt: skip
            assert paused == (True,)
    finally:
        receiver.close()
