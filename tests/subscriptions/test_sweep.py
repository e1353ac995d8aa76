"""The sweep's look for work that lost notifications left behind (PROTOCOL.md 7; DESIGN.md:
wakes follow appends at once, the sweep is the safety net). It looked at every link of every
idle subscription every second in each process: one tenant's 30 subscriptions over 20,000
streams kept two of the database's backends busy all the time (found by a probe). Now each
sweep looks at a bounded number of links, going round every subscription in turn. Servers of
these tests run on a database of their own, so only their sweeps read its links."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.subscriptions.conftest import StartServer, query
from tests.subscriptions.support import CONTROL, put_subscription, wait_until

TEXT = {"Content-Type": "text/plain"}

# What the scans of ds_subscription_link read: index entries and table rows.
LINKS_READ = (
    "SELECT coalesce((SELECT sum(idx_tup_read) FROM pg_stat_user_indexes"
    "                  WHERE relname = 'ds_subscription_link'), 0)"
    "     + coalesce((SELECT seq_tup_read FROM pg_stat_user_tables"
    "                  WHERE relname = 'ds_subscription_link'), 0)"
)


def _create_streams(base_url: str, paths: list[str]) -> None:
    def create(path: str) -> None:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            answer = client.put(f"/v1/stream/{path}", headers=TEXT, content=b"x")
            assert answer.status_code == 201, answer.text

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, paths))


def test_each_sweep_reads_a_bounded_number_of_links(
    own_servers: StartServer, own_database: str
) -> None:
    """An idle pattern subscription over 1,000 streams, swept four times a second for four
    seconds with a budget of 100 links a sweep: the link table is read about 1,600 times, where
    every sweep reading every link read it about 16,000 times."""
    server = own_servers(
        env={
            "DS_SUBSCRIPTIONS__SWEEP_INTERVAL_SECS": "0.25",
            "DS_SUBSCRIPTIONS__SWEEP_LINKS": "100",
        }
    )
    _create_streams(server.base_url, [f"idle/s/{i:04d}" for i in range(1000)])
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.put("/v1/stream/idle/wake", headers=TEXT).status_code == 201
        made = put_subscription(
            client, "idle-sub", type="pull-wake", pattern="idle/s/**", wake_stream="idle/wake"
        )
        assert made.status_code == 201, made.text
        assert len(client.get(f"{CONTROL}/subscriptions/idle-sub").json()["streams"]) == 1000
    time.sleep(2)  # the start's look at everything, and its statistics, are behind us
    before = query(own_database, LINKS_READ)[0][0]
    time.sleep(4)
    read = query(own_database, LINKS_READ)[0][0] - before
    assert read < 5000, f"{read} links read in 4 s of sweeps"
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.delete(f"{CONTROL}/subscriptions/idle-sub").status_code == 204


def test_a_lost_notification_is_found_going_round(
    own_servers: StartServer, own_database: str
) -> None:
    """Work no notification announced (a link moved back by hand: what a notification lost
    with a dying process leaves) is found by the sweep and woken, though each sweep looks at
    three links and the subscriptions hold twelve."""
    server = own_servers(
        env={"DS_SUBSCRIPTIONS__SWEEP_INTERVAL_SECS": "0.2", "DS_SUBSCRIPTIONS__SWEEP_LINKS": "3"}
    )
    paths = [f"lost/s{i}" for i in range(4)]
    _create_streams(server.base_url, paths)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.put("/v1/stream/lost/wake", headers=TEXT).status_code == 201
        for name in ("lost-a", "lost-b", "lost-c"):
            made = put_subscription(
                client, name, type="pull-wake", streams=paths, wake_stream="lost/wake"
            )
            assert made.status_code == 201, made.text
    generation = "SELECT generation FROM ds_subscription WHERE subscription_id = %s"
    assert query(own_database, generation, "lost-c") == [(0,)]
    query(
        own_database,
        "UPDATE ds_subscription_link SET acked_seq = 0, acked_pos = 0 WHERE path = %s"
        " AND sid = (SELECT id FROM ds_subscription WHERE subscription_id = %s) RETURNING 1",
        paths[-1],
        "lost-c",
    )
    wait_until(lambda: query(own_database, generation, "lost-c") == [(1,)], timeout=30)
    assert query(own_database, generation, "lost-a") == [(0,)]


def test_an_append_to_a_stream_of_many_subscriptions_wakes_each(
    own_servers: StartServer, own_database: str
) -> None:
    """Past 200 subscriptions of a stream a NOTIFY cannot name them all: it names the stream,
    and the process looks up its subscriptions (it looked at every subscription of the
    server). No sweep here: the notification alone wakes all 210."""
    server = own_servers(env={"DS_SUBSCRIPTIONS__SWEEP_INTERVAL_SECS": "0"})
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for path in ("many/s", "many/wake"):
            assert client.put(f"/v1/stream/{path}", headers=TEXT).status_code == 201
        for i in range(210):
            made = put_subscription(
                client, f"many-{i}", type="pull-wake", streams=["many/s"], wake_stream="many/wake"
            )
            assert made.status_code == 201, made.text
        assert client.post("/v1/stream/many/s", headers=TEXT, content=b"x").status_code == 204
    woken = (
        "SELECT count(*) FROM ds_subscription"
        " WHERE subscription_id LIKE 'many-%%' AND generation = 1"
    )
    wait_until(lambda: query(own_database, woken) == [(210,)], timeout=30)
