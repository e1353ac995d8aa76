"""PostgreSQL stopped and started again under load, with SSE readers following the streams.

Two servers (two workers each) share the suite's cluster. Eight idempotent producers append to
two streams, retrying each request until it is acknowledged; six SSE readers (three per stream,
on both servers) follow the streams from -1 and reconnect from their last control event's
offset whenever their connection ends. Then PostgreSQL is stopped (immediate and fast modes in
turn), kept down a few seconds, and started again; ``FAULTS_PG_RESTARTS`` times (1 in
``make test``, 3 in ``make test-faults``).

While it is down, every request must be answered 503 with Retry-After within a few seconds
(the pool's acquisition timeout), never hang and never be a 500. After it is back, no 500
either. At the end every acknowledged append is stored exactly once and in order, and every
SSE reader received exactly the stored sequence.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.faults.conftest import PG_RESTARTS, Report, StartServer
from tests.faults.processes import PgCluster, log_errors, wait_for
from tests.faults.traffic import (
    Attempt,
    Producer,
    SseReader,
    Traffic,
    create_streams,
    statuses,
    verify,
)

pytestmark = pytest.mark.faults

PRODUCERS = 8
STREAMS = 2
READERS_PER_STREAM = 3
MODES = ("immediate", "fast")
# How long PostgreSQL stays down: long enough for requests sent during the outage to be
# answered during it.
DOWN_SECONDS = 5.0
# While it is down a request must be answered within this: a few seconds, not the 30 s of a
# hang. A request that was already waiting for a connection when the database went away may
# wait out the pool's acquisition timeout (3 s), and an append queued behind another batch of
# the same stream (group commit) that batch's wait first; later ones hear at once, or within
# half a second (streams/store/pool.py, OUTAGE_WAIT_SECS).
DOWN_ANSWER_BOUND = 10.0
APPENDS_PER_CYCLE = 100


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_postgres_restarts_under_load_with_sse_readers(
    cluster: PgCluster, servers: StartServer, report: Report
) -> None:
    fleet = [servers("pg-a"), servers("pg-b")]
    run = time.time_ns()
    paths = [f"faults/pg-{run}/{index}" for index in range(STREAMS)]
    create_streams(fleet[0].base_url, paths)
    producers = [
        Producer(f"producer-{index}", paths[index % STREAMS], primary=index % len(fleet))
        for index in range(PRODUCERS)
    ]
    readers = [
        SseReader(f"reader-{path}-{n}", fleet[n % len(fleet)].base_url, path)
        for path in paths
        for n in range(READERS_PER_STREAM)
    ]
    urls = [server.base_url for server in fleet]
    traffic = Traffic(producers, lambda: urls, readers).start()
    windows: list[tuple[float, float, float]] = []  # (stop began, stopped, start began)
    try:
        wait_for(lambda: all(r.controls for r in readers), 60, "every SSE reader to connect")
        for cycle in range(PG_RESTARTS):
            traffic.wait_acknowledged(APPENDS_PER_CYCLE, 120, f"appends before stop {cycle}")
            mode = MODES[cycle % len(MODES)]
            stop_began = time.monotonic()
            stop_seconds = cluster.stop(mode)
            stopped = time.monotonic()
            # A probe while it is down, besides the producers' own requests.
            probe_started = time.monotonic()
            probe = httpx.get(
                f"{fleet[cycle % 2].base_url}/v1/stream/{paths[0]}",
                params={"offset": "-1"},
                timeout=40,
            )
            probe_seconds = time.monotonic() - probe_started
            acknowledged_down = traffic.acknowledged()
            time.sleep(max(0.0, DOWN_SECONDS - (time.monotonic() - stopped)))  # the outage
            start_began = time.monotonic()
            # Nothing is acknowledged while PostgreSQL is down (but what was in flight).
            assert traffic.acknowledged() - acknowledged_down == 0
            start_seconds = cluster.start()
            windows.append((stop_began, stopped, start_began))
            first_append = traffic.acknowledged()
            to_append = wait_for(
                lambda first=first_append: traffic.acknowledged() > first, 60, "an append"
            )
            to_ready = wait_for(
                lambda: all(_ready(url) for url in urls), 60, "every server to be ready"
            )
            report(
                restart=cycle + 1,
                mode=mode,
                stop_seconds=stop_seconds,
                probe_status=probe.status_code,
                probe_retry_after=probe.headers.get("Retry-After"),
                probe_seconds=probe_seconds,
                start_seconds=start_seconds,
                first_append_after_start_seconds=start_seconds + to_append,
                ready_after_start_seconds=start_seconds + to_append + to_ready,
            )
            assert probe.status_code == 503 and probe.headers.get("Retry-After"), probe.text
            assert probe_seconds < DOWN_ANSWER_BOUND
        traffic.wait_acknowledged(APPENDS_PER_CYCLE, 120, "appends after the last restart")
        traffic.stop_producers()
        figures = verify(fleet[0].base_url, producers)

        # Every reader catches up with the stored stream, then must hold exactly it.
        def caught_up() -> bool:
            return all(r.offset == figures.tails[r.path] for r in readers)

        wait_for(caught_up, 60, "the SSE readers to reach the tail")
    finally:
        traffic.stop()

    attempts = traffic.attempts
    failures = [failure for producer in producers for failure in producer.failures]
    down = [_answered_while_down(attempts, window) for window in windows]
    sent_while_down = [a for window in windows for a in _sent_while_down(attempts, window)]
    first_503 = [
        min((a.ended for a in attempts if a.status == 503 and a.ended >= began), default=None)
        for began, _, _ in windows
    ]
    errors = [line for server in fleet for line in log_errors(server.log_tail(10**7))]
    report(
        restarts=PG_RESTARTS,
        acknowledged=figures.acknowledged,
        stored=figures.stored,
        lost=figures.lost,
        duplicated=figures.duplicated,
        reordered=figures.reordered,
        unexpected=figures.unexpected,
        retried=figures.retried,
        duplicate_acks=figures.duplicate_acks,
        answers_503=sum(1 for a in attempts if a.status == 503),
        answers_while_down=[dict(statuses(window)) for window in down],
        slowest_answer_to_request_sent_while_down_seconds=max(
            (a.seconds for a in sent_while_down), default=0.0
        ),
        seconds_to_first_503=[
            round(at - began, 2) if at is not None else None
            for at, (began, _, _) in zip(first_503, windows, strict=True)
        ],
        sse_connections=sum(r.connections for r in readers),
        sse_clean_ends=sum(r.clean_ends for r in readers),
        sse_broken_ends=sum(r.broken_ends for r in readers),
        sse_refusals=sum(sum(r.refusals.values()) for r in readers),
        sse_messages=sum(len(r.messages) for r in readers),
        attempts=dict(statuses(attempts)),
    )
    assert not failures, failures[:20]
    figures.assert_exactly_once()
    for reader in readers:
        assert reader.messages == figures.stored_by_stream[reader.path], reader.name
    # Never a 500 (nor any 5xx but 503), before, during or after an outage; every 503 says
    # when to retry.
    assert not [a for a in attempts if a.status is not None and a.status >= 500 and a.status != 503]
    assert all(a.retry_after for a in attempts if a.status == 503)
    # While PostgreSQL was down, the server answered every request, 503, within seconds.
    for window in down:
        assert window, "no request was answered while PostgreSQL was down"
        assert {a.status for a in window} == {503}, [a for a in window if a.status != 503]
    slow = [a for a in sent_while_down if a.seconds >= DOWN_ANSWER_BOUND]
    assert not slow, [(a, a.started - w[1]) for a in slow for w in windows]
    assert not errors, errors[:20]


def _sent_while_down(attempts: list[Attempt], window: tuple[float, float, float]) -> list[Attempt]:
    _, stopped, start_began = window
    return [a for a in attempts if stopped <= a.started < start_began]


def _answered_while_down(
    attempts: list[Attempt], window: tuple[float, float, float]
) -> list[Attempt]:
    """The requests sent after PostgreSQL had stopped and answered before it was started."""
    _, _, start_began = window
    return [a for a in _sent_while_down(attempts, window) if a.ended <= start_began]
