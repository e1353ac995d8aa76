"""Webhook delivery through the real server to a real receiver (PROTOCOL.md 7.1, 7.3, 12.9,
12.10): signatures checked against the JWKS, the ``{"done": true}`` auto-ack, asynchronous
callbacks with their per-generation tokens, fencing of stale generations, and retries with
their schedule kept in the database."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest

from tests.subscriptions.conftest import StartServer
from tests.subscriptions.support import (
    CONTROL,
    Received,
    Receiver,
    acked,
    get_subscription,
    put_subscription,
    report,
    verify_signature,
    wait_until,
)


@pytest.fixture
def prefix() -> str:
    return f"hooks{time.time_ns()}"


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    started: list[Receiver] = []
    yield started
    for receiver in started:
        receiver.close()


def start(receivers: list[Receiver], answer: Any = None) -> Receiver:
    receiver = Receiver(answer)
    receivers.append(receiver)
    return receiver


def subscribe(client: httpx.Client, sub: str, receiver: Receiver, **config: Any) -> dict[str, Any]:
    response = put_subscription(
        client, sub, type="webhook", webhook={"url": receiver.url}, **config
    )
    assert response.status_code == 201, response.text
    return response.json()


def append(client: httpx.Client, path: str, data: bytes = b"event") -> str:
    response = client.post(
        f"/v1/stream/{path}", content=data, headers={"Content-Type": "text/plain"}
    )
    assert response.status_code == 204, response.text
    return response.headers["Stream-Next-Offset"]


def create(client: httpx.Client, path: str, data: bytes = b"") -> str:
    response = client.put(
        f"/v1/stream/{path}", content=data, headers={"Content-Type": "text/plain"}
    )
    assert response.status_code == 201, response.text
    return response.headers["Stream-Next-Offset"]


def test_signed_with_a_key_of_the_jwks(
    client: httpx.Client, receivers: list[Receiver], prefix: str
) -> None:
    """PROTOCOL.md 6.5, 7.1, 12.10: every request carries ``Webhook-Signature: t=,kid=,ed25519=``
    that verifies with the JWKS key of that kid over ``<t>.<raw body>``; the kid is the one
    the subscription names; a changed body does not verify; the body names the wake and its
    callback."""
    receiver = start(receivers, lambda received: (200, {"done": True}))
    sub = f"{prefix}-signed"
    created = subscribe(client, sub, receiver, pattern=f"{prefix}/*")
    jwks_response = client.get(created["webhook"]["signing"]["jwks_url"])
    assert jwks_response.status_code == 200
    assert jwks_response.headers["Content-Type"] == "application/jwk-set+json"
    assert jwks_response.headers["Cache-Control"] == "public, max-age=300"
    jwks = jwks_response.json()
    kid = created["webhook"]["signing"]["kid"]
    assert kid.startswith("ds_") and any(key["kid"] == kid for key in jwks["keys"])
    assert all("d" not in key for key in jwks["keys"])  # no private part, ever

    create(client, f"{prefix}/one", b"hello")
    (wake,) = receiver.wait(1)
    assert verify_signature(wake, jwks)
    assert f"kid={kid}," in (wake.signature or "")
    tampered = Received(wake.raw.replace(b'"generation":1', b'"generation":2'), wake.signature,
                        wake.arrived, wake.client_port)  # fmt: skip
    assert tampered.raw != wake.raw and not verify_signature(tampered, jwks)
    assert wake.body["subscription_id"] == sub
    assert wake.body["wake_id"].startswith("w_") and wake.body["generation"] == 1
    assert wake.body["callback_url"] == f"{client.base_url}{CONTROL}/subscriptions/{sub}/callback"
    assert wake.body["callback_token"].count(".") == 2


def test_done_acks_the_reported_tails_and_more_events_wake_again(
    client: httpx.Client, receivers: list[Receiver], prefix: str
) -> None:
    """PROTOCOL.md 7.1: ``{"done": true}`` acks the tails of the wake; an append after that is
    a new wake with a new wake id and the next generation."""
    receiver = start(receivers, lambda received: (200, {"done": True}))
    sub = f"{prefix}-done"
    subscribe(client, sub, receiver, pattern=f"{prefix}/*")
    path = f"{prefix}/s"
    tail = create(client, path, b"one")
    (first,) = receiver.wait(1)
    assert first.stream(path)["tail_offset"] == tail
    wait_until(lambda: acked(client, sub)[path] == tail)

    tail = append(client, path, b"two")
    second = receiver.wait(2)[1]
    assert second.generation == first.generation + 1
    assert second.body["wake_id"] != first.body["wake_id"]
    assert second.stream(path)["acked_offset"] == first.stream(path)["tail_offset"]
    assert second.stream(path)["tail_offset"] == tail
    wait_until(lambda: acked(client, sub)[path] == tail)
    assert get_subscription(client, sub)["status"] == "active"


def test_callbacks_ack_extend_and_end_the_wake_and_stale_ones_are_fenced(
    client: httpx.Client, receivers: list[Receiver], prefix: str
) -> None:
    """PROTOCOL.md 7.1, 7.3, 12.9: a receiver that answers without done calls back with its
    token: acks move the cursor, without done the wake goes on (heartbeat), with done it ends
    (next_wake false when nothing is pending); the same callback again is FENCED; a wrong or
    missing token is 401; an ack the stream cannot have is 409 INVALID_OFFSET and changes
    nothing."""
    receiver = start(receivers)
    sub = f"{prefix}-callback"
    subscribe(client, sub, receiver, pattern=f"{prefix}/*", lease_ttl_ms=60_000)
    other = f"{prefix}-other"
    subscribe(client, other, receiver, pattern=f"{prefix}/nothing-here")
    path = f"{prefix}/s"
    # One append of two JSON messages: one wake, and a position between them to ack.
    created = client.put(
        f"/v1/stream/{path}", content=b"[1,2]", headers={"Content-Type": "application/json"}
    )
    assert created.status_code == 201
    middle = "0000000000000001_0000000000000001"
    (wake,) = receiver.wait(1)
    body = wake.body
    token, wake_id, generation = body["callback_token"], body["wake_id"], body["generation"]
    tail = wake.stream(path)["tail_offset"]
    assert tail == created.headers["Stream-Next-Offset"]

    bad_acks: list[list[tuple[str, str]]] = [
        [(path, "0000000000000099_0000000000000000")],  # past the tail
        [(path, "0000000000000001_0000000000000005")],  # not a position of the stream
        [(f"{prefix}/unlinked", "0000000000000000_0000000000000000")],  # not followed
        [(path, "not-an-offset")],
    ]
    for acks in bad_acks:
        refused = report(client, sub, "callback", token, wake_id, generation, acks, done=True)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "INVALID_OFFSET"
    assert acked(client, sub)[path] == "0000000000000000_0000000000000000"

    no_token = client.post(f"{CONTROL}/subscriptions/{sub}/callback", json={})
    assert no_token.status_code == 401 and no_token.json()["error"]["code"] == "TOKEN_INVALID"
    forged = report(client, sub, "callback", token[:-2] + "xx", wake_id, generation)
    assert forged.status_code == 401
    elsewhere = report(client, other, "callback", token, wake_id, generation)
    assert elsewhere.status_code == 401
    as_claim = report(client, sub, "ack", token, wake_id, generation)
    assert as_claim.status_code in (400, 401)
    wrong_wake = report(client, sub, "callback", token, "w_" + "0" * 32, generation)
    assert wrong_wake.status_code == 409 and wrong_wake.json()["error"]["code"] == "FENCED"

    heartbeat = report(client, sub, "callback", token, wake_id, generation, [(path, middle)],
                       done=False)  # fmt: skip
    assert heartbeat.status_code == 200 and heartbeat.json() == {"ok": True, "next_wake": False}
    assert acked(client, sub)[path] == middle
    back = report(client, sub, "callback", token, wake_id, generation,
                  [(path, "0000000000000000_0000000000000000")])  # fmt: skip
    assert back.status_code == 409 and back.json()["error"]["code"] == "INVALID_OFFSET"

    done = report(client, sub, "callback", token, wake_id, generation, [(path, tail)])
    assert done.status_code == 200 and done.json() == {"ok": True, "next_wake": False}
    assert acked(client, sub)[path] == tail
    again = report(client, sub, "callback", token, wake_id, generation, [(path, tail)])
    assert again.status_code == 409 and again.json()["error"]["code"] == "FENCED"
    assert len(receiver.of(sub)) == 1


def test_done_with_pending_work_wakes_again_at_once(
    client: httpx.Client, receivers: list[Receiver], prefix: str
) -> None:
    """PROTOCOL.md 7.1: events that arrived during a wake are woken for right after it ends:
    the callback answers next_wake true and the next generation arrives."""
    receiver = start(receivers)
    sub = f"{prefix}-next"
    subscribe(client, sub, receiver, pattern=f"{prefix}/*", lease_ttl_ms=60_000)
    path = f"{prefix}/s"
    create(client, path, b"first")
    (wake,) = receiver.wait(1)
    later = append(client, path, b"during the wake")
    done = report(client, sub, "callback", wake.body["callback_token"], wake.body["wake_id"],
                  wake.generation, [(path, wake.stream(path)["tail_offset"])])  # fmt: skip
    assert done.json() == {"ok": True, "next_wake": True}
    second = receiver.wait(2)[1]
    assert second.generation == wake.generation + 1
    assert second.stream(path)["acked_offset"] == wake.stream(path)["tail_offset"]
    assert second.stream(path)["tail_offset"] == later


def test_a_stale_generation_is_fenced_after_its_lease_expired(
    client: httpx.Client, receivers: list[Receiver], prefix: str
) -> None:
    """PROTOCOL.md 7.3: a receiver that never calls back loses its wake when the lease expires;
    the pending work is woken again as the next generation, and the first generation's
    callback is FENCED (it cannot move the cursor)."""
    receiver = start(receivers)
    sub = f"{prefix}-lease"
    # The second generation's callback must come within its lease too: it is sent first, as
    # soon as the wake arrived (a loaded machine can stretch round trips past a second).
    subscribe(client, sub, receiver, pattern=f"{prefix}/*", lease_ttl_ms=3000)
    path = f"{prefix}/s"
    create(client, path, b"data")
    first, second = receiver.wait(2)[:2]
    assert second.generation == first.generation + 1
    current = report(client, sub, "callback", second.body["callback_token"],
                     second.body["wake_id"], second.generation,
                     [(path, second.stream(path)["tail_offset"])])  # fmt: skip
    assert current.status_code == 200, current.text
    tail = second.stream(path)["tail_offset"]
    assert acked(client, sub)[path] == tail
    stale = report(client, sub, "callback", first.body["callback_token"], first.body["wake_id"],
                   first.generation, [(path, "0000000000000000_0000000000000000")])  # fmt: skip
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "FENCED"
    assert acked(client, sub)[path] == tail  # the stale callback moved nothing


def test_failed_deliveries_are_retried_on_the_persisted_schedule(
    client: httpx.Client, receivers: list[Receiver], prefix: str, database_url: str
) -> None:
    """PROTOCOL.md 7.1: a receiver failing (500, then a broken answer) is retried, each
    attempt a new wake, on a schedule stored in the subscription's row (1 s, then 2 s, with
    20% jitter), shown as status failed meanwhile; once it answers done, the cursor moves and
    the status is active again."""
    schedule: list[tuple[int, timedelta]] = []

    def answer(received: Received) -> tuple[int, Any]:
        with psycopg.connect(database_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT failed_attempts, next_attempt_at - last_error_at FROM ds_subscription"
                " WHERE subscription_id = %s", (received.subscription_id,),
            ).fetchone()  # fmt: skip
        assert row is not None
        if row[0]:
            schedule.append(row)
        attempt = len(receiver.of(received.subscription_id))
        if attempt == 1:
            return 500, {"error": "down"}
        if attempt == 2:
            return 503, None
        return 200, {"done": True}

    receiver = start(receivers, answer)
    sub = f"{prefix}-retry"
    subscribe(client, sub, receiver, pattern=f"{prefix}/*")
    path = f"{prefix}/s"
    tail = create(client, path, b"data")
    receiver.wait(1)
    # Between the first failure and the success (about 3 s later) the status is failed.
    wait_until(lambda: get_subscription(client, sub)["status"] == "failed")
    attempts = receiver.wait(3)[:3]
    wait_until(lambda: acked(client, sub)[path] == tail)
    assert get_subscription(client, sub)["status"] == "active"
    assert len(receiver.of(sub)) == 3
    assert [r.generation for r in attempts] == [1, 2, 3]
    assert len({r.body["wake_id"] for r in attempts}) == 3
    assert [failures for failures, _ in schedule] == [1, 2]
    for failures, delay in schedule:
        base = 2 ** (failures - 1)
        assert 0.8 * base - 0.01 <= delay.total_seconds() <= 1.2 * base + 0.01, schedule
    for earlier, later in itertools.pairwise(attempts):
        assert later.arrived > earlier.arrived


def test_delivery_metrics(own_servers: StartServer, receivers: list[Receiver], prefix: str) -> None:
    """The delivering process counts the webhook and its duration. On a database of its own:
    every server process of a database may deliver a wake, and only this server's /metrics
    is read."""
    server = own_servers()
    receiver = start(receivers, lambda received: (200, {"done": True}))
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        subscribe(client, f"{prefix}-metrics", receiver, pattern=f"{prefix}/*")
        create(client, f"{prefix}/s", b"x")
        receiver.wait(1)

        def counted() -> bool:
            text = client.get("/metrics").text
            return 'ds_subscription_webhooks_total{outcome="done"}' in text

        wait_until(counted, timeout=10)
        text = client.get("/metrics").text
    assert "ds_subscription_webhook_duration_seconds_bucket" in text
    assert "ds_subscription_wake_seconds_bucket" in text


def test_concurrent_callbacks_of_one_wake_apply_once(
    client: httpx.Client, receivers: list[Receiver], prefix: str
) -> None:
    """Eight copies of one done callback at once: exactly one is applied (200), the others
    are FENCED."""
    receiver = start(receivers)
    sub = f"{prefix}-race"
    subscribe(client, sub, receiver, pattern=f"{prefix}/*", lease_ttl_ms=60_000)
    path = f"{prefix}/s"
    create(client, path, b"x")
    (wake,) = receiver.wait(1)
    statuses: list[int] = []

    acks = [(path, wake.stream(path)["tail_offset"])]

    def call() -> None:
        with httpx.Client(base_url=client.base_url, timeout=30) as own:
            token, wake_id = wake.body["callback_token"], wake.body["wake_id"]
            answer = report(own, sub, "callback", token, wake_id, wake.generation, acks)
            statuses.append(answer.status_code)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [200] + [409] * 7
