"""Pull-wake delivery through the real server (PROTOCOL.md 7.2, 7.3): wake events written to
the application's wake stream, claims racing for one lease, acks as heartbeats, release, lease
expiry and generation fencing."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest

from tests.subscriptions.support import CONTROL, acked, get_subscription, report, wait_until


@pytest.fixture
def prefix() -> str:
    return f"pull{time.time_ns()}"


def wake_events(client: httpx.Client, wake_stream: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/stream/{wake_stream}", params={"offset": "-1"})
    assert response.status_code == 200
    return response.json()


def setup(client: httpx.Client, prefix: str, *, lease_ttl_ms: int = 30_000) -> tuple[str, str]:
    wake_stream = f"{prefix}/wake"
    client.put(f"/v1/stream/{wake_stream}", headers={"Content-Type": "application/json"})
    sub = f"{prefix}-sub"
    created = client.put(
        f"{CONTROL}/subscriptions/{sub}",
        json={"type": "pull-wake", "pattern": f"{prefix}/events/*", "wake_stream": wake_stream,
              "lease_ttl_ms": lease_ttl_ms},
    )  # fmt: skip
    assert created.status_code == 201, created.text
    assert created.json()["webhook"] is None and created.json()["wake_stream"] == wake_stream
    return sub, wake_stream


def claim(client: httpx.Client, sub: str, worker: str) -> httpx.Response:
    return client.post(f"{CONTROL}/subscriptions/{sub}/claim", json={"worker": worker})


def test_wake_event_claim_ack_release(client: httpx.Client, prefix: str) -> None:
    """PROTOCOL.md 7.2: an append writes a wake event naming the subscription, the stream and
    the generation; one worker claims (200 with a token), another gets 409 ALREADY_CLAIMED
    with the holder; an ack without done extends the lease, with done it acks and ends;
    release ends without acking, and pending work gets another wake event."""
    sub, wake_stream = setup(client, prefix)
    path = f"{prefix}/events/a"
    client.put(f"/v1/stream/{path}", content=b"[1]", headers={"Content-Type": "application/json"})
    wait_until(lambda: len(wake_events(client, wake_stream)) == 1)
    (event,) = wake_events(client, wake_stream)
    assert event["type"] == "wake" and event["subscription_id"] == sub
    assert event["stream"] == path and event["generation"] == 1
    assert isinstance(event["ts"], int)
    assert claim(client, f"{prefix}-nothing", "w").status_code == 404

    claimed = claim(client, sub, "worker-1")
    assert claimed.status_code == 200, claimed.text
    first = claimed.json()
    assert first["generation"] == 1 and first["lease_ttl_ms"] == 30_000
    tail = next(s for s in first["streams"] if s["path"] == path)["tail_offset"]
    busy = claim(client, sub, "worker-2")
    assert busy.status_code == 409
    assert busy.json()["error"] | {"message": None} == {
        "code": "ALREADY_CLAIMED", "current_holder": "worker-1", "generation": 1, "message": None,
    }  # fmt: skip

    token, wake_id = first["token"], first["wake_id"]
    # A generation past PostgreSQL's bigint is refused as such (it was a 500: found by a probe).
    for action in ("ack", "release"):
        for huge in (2**63, 10**20):
            out_of_range = report(client, sub, action, token, wake_id, huge, done=False)
            assert out_of_range.status_code == 400, (action, huge, out_of_range.text)
    heartbeat = report(client, sub, "ack", token, wake_id, 1, done=False)
    assert heartbeat.status_code == 200 and heartbeat.json() == {"ok": True, "next_wake": False}
    as_callback = report(client, sub, "callback", token, wake_id, 1)
    assert as_callback.status_code in (400, 401)
    done = report(client, sub, "ack", token, wake_id, 1, [(path, tail)])
    assert done.status_code == 200 and done.json() == {"ok": True, "next_wake": False}
    assert acked(client, sub)[path] == tail
    stale = report(client, sub, "ack", token, wake_id, 1, [(path, tail)])
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "FENCED"
    nothing = claim(client, sub, "worker-1")
    assert nothing.status_code == 409 and nothing.json()["error"]["code"] == "NO_PENDING_WORK"

    client.post(f"/v1/stream/{path}", content=b"[2]", headers={"Content-Type": "application/json"})
    wait_until(lambda: len(wake_events(client, wake_stream)) == 2)
    second = claim(client, sub, "worker-2").json()
    assert second["generation"] == 2
    release = report(client, sub, "release", second["token"], second["wake_id"], 2)
    assert release.status_code == 204
    assert acked(client, sub)[path] == tail  # released, not acked
    # Pending work remains: another wake event, for the next generation.
    wait_until(lambda: len(wake_events(client, wake_stream)) == 3)
    assert wake_events(client, wake_stream)[-1]["generation"] == 3
    third = claim(client, sub, "worker-3").json()
    assert third["generation"] == 3


def test_an_expired_lease_returns_the_subscription_to_pending(
    client: httpx.Client, prefix: str
) -> None:
    """PROTOCOL.md 7.3: a worker that stops heartbeating loses the lease: another worker can
    claim (a new generation), a wake event is written for it, and the first worker's ack is
    FENCED and moves nothing."""
    sub, wake_stream = setup(client, prefix, lease_ttl_ms=1000)
    path = f"{prefix}/events/a"
    client.put(f"/v1/stream/{path}", content=b"[1]", headers={"Content-Type": "application/json"})
    wait_until(lambda: len(wake_events(client, wake_stream)) == 1)
    first = claim(client, sub, "slow-worker").json()
    tail = first["streams"][0]["tail_offset"]
    # The sweep ends the lease and writes a wake event for the next generation.
    wait_until(lambda: len(wake_events(client, wake_stream)) == 2, timeout=30)
    assert wake_events(client, wake_stream)[-1]["generation"] == first["generation"] + 1
    second = claim(client, sub, "fast-worker")
    assert second.status_code == 200, second.text
    assert second.json()["generation"] == first["generation"] + 1
    late = report(client, sub, "ack", first["token"], first["wake_id"], first["generation"],
                  [(path, tail)])  # fmt: skip
    assert late.status_code == 409 and late.json()["error"]["code"] == "FENCED"
    assert acked(client, sub)[path] == "0000000000000000_0000000000000000"


def test_claims_racing_through_two_processes_get_one_lease(
    client: httpx.Client, start_server: Any, prefix: str
) -> None:
    """Several server processes, one lease: of 12 claims at once, through two processes,
    exactly one is granted."""
    other = start_server()
    sub, wake_stream = setup(client, prefix)
    client.put(
        f"/v1/stream/{prefix}/events/a", content=b"[1]",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    wait_until(lambda: len(wake_events(client, wake_stream)) == 1)
    statuses: list[int] = []

    def race(base_url: str, worker: str) -> None:
        with httpx.Client(base_url=base_url, timeout=30) as own:
            statuses.append(claim(own, sub, worker).status_code)

    threads = [
        threading.Thread(target=race, args=(base, f"w{i}"))
        for i, base in enumerate([client.base_url, other.base_url] * 6)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [200] + [409] * 11


def test_a_missing_wake_stream_is_recorded_and_the_wake_stays_claimable(
    client: httpx.Client, prefix: str, pg: Any
) -> None:
    """PROTOCOL.md 7.2 says the application creates the wake stream: without it the wake is
    still issued (a claim gets it) and the reason is recorded for the operator."""
    sub = f"{prefix}-nowake"
    created = client.put(
        f"{CONTROL}/subscriptions/{sub}",
        json={"type": "pull-wake", "streams": [f"{prefix}/s"], "wake_stream": f"{prefix}/w"},
    )
    assert created.status_code == 201
    client.put(f"/v1/stream/{prefix}/s", content=b"x", headers={"Content-Type": "text/plain"})

    def last_error() -> str:
        query = "SELECT last_error FROM ds_subscription WHERE subscription_id = %s"
        return pg.execute(query, (sub,)).fetchone()[0]

    wait_until(lambda: last_error() != "")
    error = last_error()
    assert claim(client, sub, "w").status_code == 200
    assert get_subscription(client, sub)["status"] == "active"
    assert error == f"the wake stream {prefix}/w does not exist"


def test_a_wake_nobody_claims_is_announced_again_after_its_lease(
    client: httpx.Client, prefix: str
) -> None:
    """A wake whose event could not be written (its wake stream missing), or that no worker
    heard of, stayed issued for good: no lease, no deadline, and no new wake while it was in
    flight, so the subscription stalled even after the wake stream was created again (found by
    a probe). An unclaimed wake now ends after the lease and is announced again, a new
    generation, once the wake stream takes it; a claim still takes the wake in flight."""
    sub = f"{prefix}-stalled"
    wake_stream = f"{prefix}/wake"
    created = client.put(
        f"{CONTROL}/subscriptions/{sub}",
        json={"type": "pull-wake", "streams": [f"{prefix}/s"], "wake_stream": wake_stream,
              "lease_ttl_ms": 1000},
    )  # fmt: skip
    assert created.status_code == 201
    client.put(f"/v1/stream/{prefix}/s", content=b"x", headers={"Content-Type": "text/plain"})
    time.sleep(1.5)  # issued, unannounced: the wake stream does not exist yet
    json_type = {"Content-Type": "application/json"}
    assert client.put(f"/v1/stream/{wake_stream}", headers=json_type).status_code == 201
    wait_until(lambda: len(wake_events(client, wake_stream)) >= 1, timeout=30)
    event = wake_events(client, wake_stream)[0]
    claimed = claim(client, sub, "w")
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["generation"] >= event["generation"] >= 2


def test_an_announced_wake_waits_for_a_claim(client: httpx.Client, prefix: str) -> None:
    """7.3: a wake whose event was written waits for a worker's claim; the first version of the
    fix above announced it again every lease, so an idle subscription's wake stream grew by an
    event a lease for as long as no worker came (found by review)."""
    sub, wake_stream = setup(client, prefix, lease_ttl_ms=1000)
    path = f"{prefix}/events/a"
    client.put(f"/v1/stream/{path}", content=b"[1]", headers={"Content-Type": "application/json"})
    wait_until(lambda: len(wake_events(client, wake_stream)) == 1)
    time.sleep(3.5)  # three leases and more, and the sweep's second
    assert len(wake_events(client, wake_stream)) == 1
    claimed = claim(client, sub, "late-worker")
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["generation"] == wake_events(client, wake_stream)[0]["generation"]


def test_wake_events_are_written_only_to_a_json_wake_stream(
    client: httpx.Client, prefix: str, pg: Any
) -> None:
    """Wake events are JSON messages (docs/gaps.md): written to a text/plain wake stream they
    ran together without boundaries (found by a probe). Such a stream gets none; the reason is
    recorded and the wake stays claimable."""
    sub = f"{prefix}-textwake"
    wake_stream = f"{prefix}/textwake"
    assert client.put(
        f"/v1/stream/{wake_stream}", headers={"Content-Type": "text/plain"}
    ).is_success
    created = client.put(
        f"{CONTROL}/subscriptions/{sub}",
        json={"type": "pull-wake", "streams": [f"{prefix}/s"], "wake_stream": wake_stream},
    )
    assert created.status_code == 201
    client.put(f"/v1/stream/{prefix}/s", content=b"x", headers={"Content-Type": "text/plain"})
    query = "SELECT last_error FROM ds_subscription WHERE subscription_id = %s"
    wait_until(lambda: pg.execute(query, (sub,)).fetchone()[0] != "")
    assert "not application/json" in pg.execute(query, (sub,)).fetchone()[0]
    assert client.get(f"/v1/stream/{wake_stream}", params={"offset": "-1"}).content == b""
    assert claim(client, sub, "w").status_code == 200


def test_claim_bodies_and_types_are_checked(client: httpx.Client, prefix: str) -> None:
    sub, _ = setup(client, prefix)
    url = f"{CONTROL}/subscriptions/{sub}/claim"
    for body in (b"", b"{", b'{"worker": ""}', b'{"worker": 5}', b'["w"]'):
        response = client.post(url, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (body, response.text)
    hook = f"{prefix}-hook"
    client.put(
        f"{CONTROL}/subscriptions/{hook}",
        json={"type": "webhook", "streams": ["x"], "webhook": {"url": "http://127.0.0.1:9/"}},
    )
    assert claim(client, hook, "w").status_code == 400


def test_an_ack_of_a_stream_deleted_and_created_again_is_refused(
    client: httpx.Client, prefix: str
) -> None:
    """A worker claims a wake, the stream is deleted and created again at its path and gets
    messages of the same sizes, and the worker acks the old stream's tail: that offset is a
    position of the new stream too, and it moved the new stream's cursor past messages never
    delivered (found by a probe). It is refused (409 INVALID_OFFSET), the cursor stays at the
    new stream's start, and the new messages are still pending."""
    sub, _ = setup(client, prefix)
    path = f"{prefix}/events/a"
    json_type = {"Content-Type": "application/json"}
    client.put(f"/v1/stream/{path}", headers=json_type)
    for i in range(5):
        client.post(f"/v1/stream/{path}", content=f'{{"n": {i}}}', headers=json_type)
    claimed = claim(client, sub, "worker-1")
    assert claimed.status_code == 200, claimed.text
    wake = claimed.json()
    tail = next(s for s in wake["streams"] if s["path"] == path)["tail_offset"]
    assert client.delete(f"/v1/stream/{path}").status_code == 204
    client.put(f"/v1/stream/{path}", headers=json_type)
    for i in range(5):
        client.post(f"/v1/stream/{path}", content=f'{{"m": {i}}}', headers=json_type)
    stale = report(
        client, sub, "ack", wake["token"], wake["wake_id"], wake["generation"], [(path, tail)]
    )
    assert stale.status_code == 409, stale.text
    assert stale.json()["error"]["code"] == "INVALID_OFFSET"
    assert "created again" in stale.text, stale.text
    assert acked(client, sub)[path] == "0000000000000000_0000000000000000"
    released = report(client, sub, "release", wake["token"], wake["wake_id"], wake["generation"])
    assert released.status_code in (200, 204), released.text
    again = claim(client, sub, "worker-1")
    assert again.status_code == 200, again.text
    pending = next(s for s in again.json()["streams"] if s["path"] == path)
    assert pending["has_pending"] and pending["acked_offset"] == "0000000000000000_0000000000000000"


def test_a_stream_created_between_the_wake_and_the_claim_is_acked(
    client: httpx.Client, prefix: str
) -> None:
    """A stream created under the pattern after the wake was issued, but before the claim,
    is listed by the claim with its tail; acking it with the other streams succeeds (found by
    review: a check of creation times against the wake's refused it as re-created, and with
    it the whole ack)."""
    sub, wake_stream = setup(client, prefix)
    json_type = {"Content-Type": "application/json"}
    first, second = f"{prefix}/events/a", f"{prefix}/events/b"
    client.put(f"/v1/stream/{first}", content=b"[1]", headers=json_type)
    wait_until(lambda: len(wake_events(client, wake_stream)) == 1)
    client.put(f"/v1/stream/{second}", headers=json_type)
    for i in range(3):
        client.post(f"/v1/stream/{second}", content=f'{{"n": {i}}}', headers=json_type)
    claimed = claim(client, sub, "worker-1")
    assert claimed.status_code == 200, claimed.text
    wake = claimed.json()
    tails = {s["path"]: s["tail_offset"] for s in wake["streams"]}
    assert set(tails) == {first, second}
    assert all("stream_id" not in s for s in wake["streams"])  # internal, not shown
    acks = [(first, tails[first]), (second, tails[second])]
    done = report(client, sub, "ack", wake["token"], wake["wake_id"], wake["generation"], acks)
    assert done.status_code == 200, done.text
    assert acked(client, sub) == tails


def _deadlocks(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as db:
        db.execute("SELECT pg_stat_clear_snapshot()")
        row = db.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_creates_under_patterns_racing_claims_and_acks_do_not_deadlock(
    server: Any, database_url: str, prefix: str
) -> None:
    """Streams created under four pattern subscriptions while workers claim, ack and release
    their wakes and writers append. A create's new links check their subscriptions' rows (a
    foreign key: a key-share lock, taken in the order the trigger found them), while wakes,
    claims and acks locked those rows FOR UPDATE, which excludes key-share: PostgreSQL found
    deadlocks (37 in 20 s of a probe's script, each a second's stall before the retry). The
    rows are now locked FOR NO KEY UPDATE (what an update of their other columns takes), and
    the trigger takes its locks in id order. Counted by PostgreSQL: none in this run."""
    json_type = {"Content-Type": "application/json"}
    subs = [f"{prefix}-s{k}" for k in range(4)]
    seconds = 6.0
    statuses: dict[int, int] = {}

    async def request(http: httpx.AsyncClient, method: str, url: str, **kw: Any) -> httpx.Response:
        response = await http.request(method, url, **kw)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        return response

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            for k, sub in enumerate(subs):
                await request(http, "PUT", f"/v1/stream/{prefix}-wake/{k}", headers=json_type)
                created = await request(
                    http, "PUT", f"{CONTROL}/subscriptions/{sub}",
                    json={"type": "pull-wake", "pattern": f"{prefix}/*",
                          "wake_stream": f"{prefix}-wake/{k}", "lease_ttl_ms": 5000},
                )  # fmt: skip
                assert created.status_code == 201, created.text
            for j in range(8):
                await request(http, "PUT", f"/v1/stream/{prefix}/{j}", headers=json_type)
            end = time.monotonic() + seconds

            async def append(n: int) -> None:
                while time.monotonic() < end:
                    url = f"/v1/stream/{prefix}/{n % 8}"
                    await request(http, "POST", url, content=b'{"x": 1}', headers=json_type)
                    n += 1

            async def create(n: int) -> None:
                while time.monotonic() < end:
                    url = f"/v1/stream/{prefix}/new-{n}-{time.time_ns()}"
                    await request(http, "PUT", url, headers=json_type)

            async def work(sub: str, worker: str) -> None:
                while time.monotonic() < end:
                    claimed = await request(
                        http, "POST", f"{CONTROL}/subscriptions/{sub}/claim",
                        json={"worker": worker},
                    )  # fmt: skip
                    if claimed.status_code != 200:
                        await asyncio.sleep(0.02)
                        continue
                    wake = claimed.json()
                    acks = [
                        {"stream": s["path"], "offset": s["tail_offset"]} for s in wake["streams"]
                    ]
                    action = "release" if len(acks) % 3 == 0 else "ack"
                    await request(
                        http, "POST", f"{CONTROL}/subscriptions/{sub}/{action}",
                        headers={"Authorization": f"Bearer {wake['token']}"},
                        json={"wake_id": wake["wake_id"], "generation": wake["generation"],
                              "acks": acks if action == "ack" else [], "done": True},
                    )  # fmt: skip

            await asyncio.gather(
                *(append(n) for n in range(4)),
                *(create(n) for n in range(2)),
                *(work(sub, f"w{w}") for sub in subs for w in range(2)),
            )

    before = _deadlocks(database_url)
    asyncio.run(scenario())
    time.sleep(1.5)  # a backend reports its statistics at most once a second
    assert _deadlocks(database_url) == before, statuses
    assert not [status for status in statuses if status >= 500], statuses
