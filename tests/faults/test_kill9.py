"""kill -9 under idempotent producers: no acknowledged append is lost, duplicated or reordered.

Two servers (the production command, two workers each) serve the suite's database. 16
idempotent producers append to four streams through whichever server answers, retrying each
request with the same Producer-Seq until it is acknowledged. Each cycle kills with SIGKILL, in
turn: one worker (its master replaces it), every process of one server (then started again on
its port), one worker, and every process of both servers at once (a total outage: producers
retry until a server is back). Requests in flight die with their process: some were committed,
some not, and the clients cannot tell; their retries must be stored exactly once.

At the end every producer finishes its last request, and each stream is read back by offset:
every acknowledged append must be there exactly once, each producer's in the order it sent
them, the acknowledged offsets in the stored order, and nothing else.

``FAULTS_KILL_CYCLES`` cycles (2 in ``make test``, 20 in ``make test-faults``).
"""

from __future__ import annotations

import time

import pytest

from tests.faults.conftest import KILL_CYCLES, Report, StartServer
from tests.faults.processes import PgCluster, log_errors
from tests.faults.traffic import Producer, Traffic, create_streams, statuses, verify

pytestmark = pytest.mark.faults

PRODUCERS = 16
STREAMS = 4
# Appends acknowledged between two kills (the producers keep appending during each kill).
APPENDS_PER_CYCLE = 150
KINDS = ("worker", "server", "worker", "all servers")


def test_kill_9_never_loses_or_duplicates_acknowledged_appends(
    cluster: PgCluster, servers: StartServer, report: Report
) -> None:
    fleet = [servers("kill-a"), servers("kill-b")]
    run = time.time_ns()
    paths = [f"faults/kill-{run}/{index}" for index in range(STREAMS)]
    create_streams(fleet[0].base_url, paths)
    producers = [
        Producer(f"producer-{index}", paths[index % STREAMS], primary=index % len(fleet))
        for index in range(PRODUCERS)
    ]
    urls = [server.base_url for server in fleet]
    traffic = Traffic(producers, lambda: urls).start()
    kills: dict[str, int] = {}
    try:
        for cycle in range(KILL_CYCLES):
            traffic.wait_acknowledged(APPENDS_PER_CYCLE, 120, f"appends before kill {cycle}")
            kind = KINDS[cycle % len(KINDS)]
            victim = fleet[cycle % len(fleet)]
            before = traffic.acknowledged()
            if kind == "worker":
                pid, restart = victim.kill_worker(cycle // len(fleet))
                what = f"worker {pid} of {victim.name}"
            elif kind == "server":
                victim.kill_all()
                restart = victim.start()
                what = f"every process of {victim.name}"
            else:
                for server in fleet:
                    server.kill_all()
                # The outage: the producers keep retrying meanwhile, and nothing is
                # acknowledged (after the answers already received are taken in).
                time.sleep(0.3)
                down_from = traffic.acknowledged()
                time.sleep(0.5)
                assert traffic.acknowledged() == down_from
                restart = sum(server.start() for server in fleet)
                what = "every process of both servers"
            kills[kind] = kills.get(kind, 0) + 1
            traffic.wait_acknowledged(1, 120, f"an append after kill {cycle}")
            report(
                cycle=cycle + 1,
                killed=what,
                restart_seconds=restart,
                acknowledged_before=before,
            )
        traffic.wait_acknowledged(APPENDS_PER_CYCLE, 120, "appends after the last kill")
        traffic.stop_producers()
    finally:
        traffic.stop()

    figures = verify(fleet[0].base_url, producers)
    # Both servers read the same streams.
    again = verify(fleet[1].base_url, producers)
    seen = statuses(traffic.attempts)
    failures = [failure for producer in producers for failure in producer.failures]
    errors = [line for server in fleet for line in log_errors(server.log_tail(10**7))]
    report(
        cycles=KILL_CYCLES,
        kills=kills,
        acknowledged=figures.acknowledged,
        stored=figures.stored,
        lost=figures.lost,
        duplicated=figures.duplicated,
        reordered=figures.reordered,
        unexpected=figures.unexpected,
        offset_mismatches=figures.offset_mismatches,
        retried=figures.retried,
        duplicate_acks=figures.duplicate_acks,
        attempts=dict(seen),
    )
    assert not failures, failures[:20]
    figures.assert_exactly_once()
    assert again.stored_by_stream == figures.stored_by_stream
    # Killed processes cut connections; no server answered with an error of its own.
    assert not [status for status in seen if status.startswith("5") and status != "503"], seen
    assert not errors, errors[:20]
