"""Subscriptions across server processes that stop, restart and die (PROTOCOL.md 7; DESIGN.md:
leases and retries are rows, not one process's memory). Servers of these tests run on a
database of their own (tests/subscriptions/conftest.py), so only they deliver its wakes."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import defaultdict
from typing import Any

import httpx
import psutil

from tests.subscriptions.conftest import StartServer, query
from tests.subscriptions.support import Received, Receiver, acked, put_subscription, wait_until

FAST = {
    "DS_SUBSCRIPTIONS__SWEEP_INTERVAL_SECS": "0.5",
    "DS_SUBSCRIPTIONS__WEBHOOK_TIMEOUT_SECS": "3",
}


def test_a_restart_honours_the_retry_schedule(own_servers: StartServer, own_database: str) -> None:
    """PROTOCOL.md 7.1: the retry schedule is kept in the subscription's row. A receiver fails
    four times; the server that scheduled the fifth attempt (about 8 s later) stops; another
    server, started meanwhile, makes that attempt no earlier than scheduled, and it is
    delivered."""
    receiver = Receiver(
        lambda r: (500, None) if r.generation <= 4 else (200, {"done": True})
    )  # fmt: skip
    try:
        first = own_servers(env=FAST)
        sub = f"restart-{time.time_ns()}"
        path = f"{sub}/s"
        with httpx.Client(base_url=first.base_url, timeout=30) as client:
            response = put_subscription(
                client, sub, type="webhook", streams=[path], webhook={"url": receiver.url}
            )
            assert response.status_code == 201
            tail = client.put(
                f"/v1/stream/{path}", content=b"x", headers={"Content-Type": "text/plain"}
            ).headers["Stream-Next-Offset"]
        sql = (
            "SELECT failed_attempts, next_attempt_at, extract(epoch FROM next_attempt_at)"
            " FROM ds_subscription WHERE subscription_id = %s"
        )
        wait_until(lambda: query(own_database, sql, sub)[0][0] == 4, timeout=60)
        first.stop()
        (_, scheduled, scheduled_epoch), = query(own_database, sql, sub)  # fmt: skip
        assert len(receiver.received) == 4

        second = own_servers(env=FAST)
        fifth = receiver.wait(5, timeout=60)[4]
        assert fifth.generation == 5
        assert fifth.arrived >= float(scheduled_epoch) - 0.01, (fifth.arrived, scheduled)
        with httpx.Client(base_url=second.base_url, timeout=30) as client:
            wait_until(lambda: acked(client, sub)[path] == tail)
    finally:
        receiver.close()


def test_each_delivery_checks_the_url_again(own_servers: StartServer, own_database: str) -> None:
    """PROTOCOL.md 12.8: a loopback webhook accepted by a development server is not delivered
    by a production server (no loopback exception) of the same database: every delivery
    checks the URL again. The refusal is a failed attempt, recorded; the receiver hears
    nothing."""
    receiver = Receiver(lambda r: (200, {"done": True}))
    try:
        development = own_servers()
        sub = f"recheck-{time.time_ns()}"
        with httpx.Client(base_url=development.base_url, timeout=30) as client:
            response = put_subscription(
                client, sub, type="webhook", streams=[f"{sub}/s"], webhook={"url": receiver.url}
            )
            assert response.status_code == 201
        development.stop()
        production = own_servers(env={"DS_SUBSCRIPTIONS__ALLOW_LOOPBACK_WEBHOOKS": None})
        with httpx.Client(base_url=production.base_url, timeout=30) as client:
            client.put(f"/v1/stream/{sub}/s", content=b"x", headers={"Content-Type": "text/plain"})
        sql = "SELECT failed_attempts, last_error FROM ds_subscription WHERE subscription_id = %s"
        wait_until(lambda: query(own_database, sql, sub)[0][0] >= 1)
        (_, error), = query(own_database, sql, sub)  # fmt: skip
        assert "must use https://" in error
        assert receiver.received == []
    finally:
        receiver.close()


def test_wakes_cut_by_a_stop_are_sent_again_at_once(
    own_servers: StartServer, own_database: str
) -> None:
    """Probe 10f: a server stopped while a webhook request was unanswered left the wake as
    "sending" until the webhook's timeout (plus a margin) had passed: with a 600 s timeout, a
    server started at once sent nothing for ten minutes. A stopping server hands back the
    wakes it was sending; the next sweep sends them again."""
    release = threading.Event()

    def answer(received: Received) -> tuple[int, Any]:
        if received.generation == 1:
            release.wait(60)  # unanswered while the server stops
        return 200, {"done": True}

    receiver = Receiver(answer)
    try:
        patient = FAST | {"DS_SUBSCRIPTIONS__WEBHOOK_TIMEOUT_SECS": "600"}
        first = own_servers(env=patient)
        sub = f"handed-back-{time.time_ns()}"
        path = f"{sub}/s"
        with httpx.Client(base_url=first.base_url, timeout=30) as client:
            response = put_subscription(
                client, sub, type="webhook", streams=[path], webhook={"url": receiver.url}
            )
            assert response.status_code == 201
            client.put(f"/v1/stream/{path}", content=b"x", headers={"Content-Type": "text/plain"})
        receiver.wait(1)
        first.stop()
        own_servers(env=patient)
        second_wake = receiver.wait(2, timeout=30)[1]
        assert second_wake.generation == 2
        assert second_wake.stream(path)["tail_offset"]
    finally:
        release.set()
        receiver.close()


def test_an_append_right_after_a_done_is_woken_without_the_sweep(
    own_servers: StartServer,
) -> None:
    """Two worker processes and no sweep at all: every append made as soon as the previous
    webhook arrived (while its done is being recorded, by either process) must be woken by its
    notification alone. Before the fix, a wake attempt that read the subscription as busy
    before the done committed skipped it, the done had not seen the append yet, and the
    append waited for the sweep (about 1% of 300 rounds; without a sweep, forever)."""
    receiver = Receiver(lambda r: (200, {"done": True}))
    try:
        server = own_servers(env={"DS_SUBSCRIPTIONS__SWEEP_INTERVAL_SECS": "0"}, workers=2)
        sub = f"race-{time.time_ns()}"
        path = f"{sub}/s"
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            client.put(f"/v1/stream/{path}", headers={"Content-Type": "text/plain"})
            config = {"type": "webhook", "streams": [path], "webhook": {"url": receiver.url}}
            assert put_subscription(client, sub, **config).status_code == 201
            for _ in range(200):
                tail = client.post(f"/v1/stream/{path}", content=b"x",
                                   headers={"Content-Type": "text/plain"}
                                   ).headers["Stream-Next-Offset"]  # fmt: skip
                receiver.wait_for(
                    lambda got, tail=tail: any(r.stream(path)["tail_offset"] >= tail for r in got),
                    timeout=10,
                )
    finally:
        receiver.close()


class Appender:
    """Appends through whichever servers are alive, as an idempotent producer, retrying a
    request that met a dead server through another (the same Producer-Seq: stored once)."""

    def __init__(self, servers: list[Any], streams: list[str], count: int, name: str) -> None:
        self.servers, self.streams, self.count, self.name = servers, streams, count, name
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        rng = random.Random(self.name)
        with httpx.Client(timeout=10) as client:
            for seq in range(self.count):
                path = rng.choice(self.streams)
                for _ in range(100):
                    server = rng.choice([s for s in self.servers if s.process.poll() is None])
                    try:
                        response = client.post(
                            server.stream_url(path),
                            content=b"[%d]" % seq,
                            headers={"Content-Type": "application/json",
                                     "Producer-Id": f"{self.name}-{path}", "Producer-Epoch": "0",
                                     "Producer-Seq": str(self._next(path))},
                        )  # fmt: skip
                    except httpx.HTTPError:
                        continue
                    if response.status_code in (200, 204):
                        self._sent[path] += 1
                        break
                time.sleep(rng.uniform(0, 0.02))

    _sent: defaultdict[str, int]

    def _next(self, path: str) -> int:
        return self._sent[path]

    def start(self) -> None:
        self._sent = defaultdict(int)
        self.thread.start()


def test_several_processes_one_wake_in_flight_nothing_lost_none_twice(
    own_servers: StartServer, own_database: str
) -> None:
    """Three server processes deliver five subscriptions (one over every stream) while three
    producers append to twelve streams through them; one process is killed (kill -9) while
    the receiver holds a webhook request it sent. Then:

    * no subscription ever had two webhook requests in flight (one wake at a time);
    * no generation and no wake id was delivered twice;
    * each subscription's generations arrived in increasing order;
    * every wake reported, as a stream's acked offset, the start or a tail an earlier wake of
      its subscription reported (no events skipped), and the wake after the killed one
      reported the same acked offsets as the killed one (its done was never applied: fenced);
    * in the end every subscription's cursors reach every stream's tail (nothing lost)."""
    hold = threading.Event()
    release = threading.Event()
    held: list[Received] = []

    def answer(received: Received) -> tuple[int, Any]:
        if hold.is_set() and not held:
            held.append(received)
            release.wait(60)
            return 200, {"done": True}
        time.sleep(random.uniform(0, 0.03))
        return 200, {"done": True}

    receiver = Receiver(answer)
    try:
        servers = [own_servers(env=FAST) for _ in range(3)]
        run = f"mp{time.time_ns()}"
        streams = [f"{run}/g{g}/s{i}" for g in range(4) for i in range(3)]
        with httpx.Client(base_url=servers[0].base_url, timeout=30) as client:
            for path in streams:
                client.put(f"/v1/stream/{path}", headers={"Content-Type": "application/json"})
            subs = [f"{run}-g{g}" for g in range(4)] + [f"{run}-all"]
            for g in range(4):
                config = {"type": "webhook", "pattern": f"{run}/g{g}/*",
                          "webhook": {"url": receiver.url}}  # fmt: skip
                assert put_subscription(client, subs[g], **config).status_code == 201
            config = {"type": "webhook", "pattern": f"{run}/**", "webhook": {"url": receiver.url}}
            assert put_subscription(client, subs[4], **config).status_code == 201

        appenders = [Appender(servers, streams, 60, f"producer{i}") for i in range(3)]
        for appender in appenders:
            appender.start()
        receiver.wait(10)
        hold.set()
        wait_until(lambda: bool(held), timeout=60)
        victim = _sender_of(held[0], servers, receiver)
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.wait(10)
        release.set()
        for appender in appenders:
            appender.thread.join(120)
        alive = next(s for s in servers if s.process.poll() is None)
        with httpx.Client(base_url=alive.base_url, timeout=30) as client:
            tails = {
                path: client.head(f"/v1/stream/{path}").headers["Stream-Next-Offset"]
                for path in streams
            }

            def caught_up() -> bool:
                return all(
                    offset == tails[path]
                    for sub in subs
                    for path, offset in acked(client, sub).items()
                )

            wait_until(caught_up, timeout=120)
            for sub in subs:
                assert set(acked(client, sub)) == {
                    p for p in streams if sub.endswith("-all") or p.startswith(f"{run}/g{sub[-1]}")
                }
    finally:
        release.set()
        receiver.close()

    received = receiver.received
    assert max(receiver.most_in_flight.values()) == 1, receiver.most_in_flight
    keys = [(r.subscription_id, r.generation) for r in received]
    assert len(keys) == len(set(keys)), "a generation was delivered twice"
    assert len({r.body["wake_id"] for r in received}) == len(received)
    killed = held[0]
    for sub in subs:
        wakes = receiver.of(sub)
        assert [w.generation for w in wakes] == sorted(w.generation for w in wakes)
        reported: defaultdict[str, set[str]] = defaultdict(
            lambda: {"0000000000000000_0000000000000000"}
        )
        for wake in wakes:
            for stream in wake.body["streams"]:
                assert stream["acked_offset"] in reported[stream["path"]], (sub, stream)
            for stream in wake.body["streams"]:
                if wake is not killed:
                    reported[stream["path"]].add(stream["tail_offset"])
        if killed.subscription_id == sub:
            after = next(w for w in wakes if w.generation > killed.generation)
            before = {s["path"]: s["acked_offset"] for s in killed.body["streams"]}
            assert {p: o for p, o in ((s["path"], s["acked_offset"]) for s in after.body["streams"])
                    if p in before} == before  # fmt: skip
    print(
        f"[subscriptions] {len(received)} webhooks, {len(subs)} subscriptions, killed"
        f" {killed.subscription_id} generation {killed.generation}"
    )


def _sender_of(request: Received, servers: list[Any], receiver: Receiver) -> Any:
    """The server process whose TCP connection carries this webhook request."""
    port = int(receiver.url.split(":")[2].split("/")[0])
    for server in servers:
        for conn in psutil.Process(server.process.pid).net_connections(kind="tcp"):
            if (
                conn.laddr
                and conn.raddr
                and (conn.laddr.port, conn.raddr.port) == (request.client_port, port)
            ):
                return server
    raise AssertionError("no server holds the webhook request's connection")
