"""``spark_materialize`` against a live server: readers of the state API see the old state or
the new one, never a mix, and appends made while the job runs are not lost.

Contract: spark/publish.py ("Readers see the old state or the new one, never a mix; nothing
appended during the job is lost") and the state API's read-your-writes (state/api/views.py,
STATE-PROTOCOL.md 6). Each test runs ``manage.py spark_materialize`` as a subprocess while
threads talk to the real server over HTTP.
"""

from __future__ import annotations

import concurrent.futures
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
import pytest

from state.core import MaterializedState
from tests.conftest import ROOT, ServerProcess, command_env, manage
from tests.spark.support import (
    COMMAND_TIMEOUT,
    TYPES,
    Entity,
    api_entities,
    canonical,
    damage,
    db_entities,
    db_registration,
    history,
    normalized,
    output_number,
)
from tests.state.support import (
    append_batches,
    append_ok,
    change,
    control,
    create_json_stream,
    entities,
    read_messages,
    register_ok,
    tail,
)

pytestmark = pytest.mark.slow


def create_state_stream(http: httpx.Client, path: str, messages: list[Any]) -> None:
    create_json_stream(http, path)
    append_batches(http, path, messages)
    register_ok(http, path)


def start_spark(database_url: str, path: str) -> subprocess.Popen[str]:
    """``spark_materialize --stream PATH`` in the background, its output line by line."""
    return subprocess.Popen(
        [sys.executable, "manage.py", "spark_materialize", "--partitions", "4", "--stream", path],
        cwd=ROOT,
        env=command_env(database_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# -- readers see the old state or the new one ---------------------------------------------


@dataclass
class Observations:
    """What the readers saw, by kind: "old", "new", or "mixed"/"error" with details."""

    counts: Counter[tuple[str, bool]] = field(default_factory=Counter)  # (kind, during run)
    anomalies: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, during: bool, detail: str = "") -> None:
        with self.lock:
            self.counts[kind, during] += 1
            if detail:
                self.anomalies.append(detail)


def test_readers_see_old_or_new(
    http: httpx.Client, server: ServerProcess, database_url: str, pg: psycopg.Connection[Any]
) -> None:
    """spark/publish.py: the swap is one transaction, so every response of GET
    /v1/state/entities (one page: the whole state) is exactly the state before the run or
    exactly the state after it; the final state is the correct one."""
    path = f"tests/spark/readers/{time.time_ns()}"
    rng = random.Random(7)
    create_state_stream(http, path, history(rng, 20_000, keys_per_type=100))
    new = db_entities(pg, path)
    assert 300 < len(new) <= 1000  # the whole state fits one page of the API

    # "old": the stored state made wrong, as a crash or a bug could leave it; the Spark run
    # must replace it with "new".
    old = damage(pg, path)
    states = {"old": normalized(old), "new": normalized(new)}
    assert states["old"] != states["new"]

    observations = Observations()
    running = threading.Event()
    stop = threading.Event()

    def reader() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            while not stop.is_set():
                during = running.is_set()
                response = client.get(
                    "/v1/state/entities", params={"stream": path, "page_size": 1000}
                )
                during = during and running.is_set()
                if response.status_code != 200:
                    observations.record("error", during, f"{response.status_code}: {response.text}")
                    continue
                page = response.json()
                seen = api_entities(page["results"])
                kind = next((k for k, state in states.items() if seen == state), "mixed")
                if kind != "mixed" and page["count"] != len(states[kind]):
                    kind = "mixed"  # the count of one state with the results of the other
                not_new, not_old = len(seen - states["new"]), len(seen - states["old"])
                detail = (
                    f"count {page['count']}, {len(seen)} results: "
                    f"{not_new} not in the new state, {not_old} not in the old"
                )
                observations.record(kind, during, detail if kind == "mixed" else "")

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        readers = [pool.submit(reader) for _ in range(4)]
        try:
            time.sleep(0.5)
            running.set()
            process = start_spark(database_url, path)
            stdout, stderr = process.communicate(timeout=COMMAND_TIMEOUT)
            running.clear()
            time.sleep(1)  # readers keep reading the new state after the run
        finally:
            stop.set()
        for future in readers:
            future.result(timeout=150)  # a reader's error fails the test
    print(f"responses (kind, during the run): {dict(observations.counts)}")

    assert process.returncode == 0, stdout + stderr
    assert "publish: 1 streams swapped in one transaction" in stdout
    assert observations.anomalies == []
    assert set(kind for kind, _ in observations.counts) <= {"old", "new"}
    assert observations.counts["old", True] > 0  # readers were reading while Spark ran
    assert observations.counts["new", False] > 0
    assert db_entities(pg, path) == new


# -- appends during the job -----------------------------------------------------------------


def test_appends_during_the_job_are_not_lost(
    http: httpx.Client, server: ServerProcess, database_url: str, pg: psycopg.Connection[Any]
) -> None:
    """spark/publish.py: messages appended after the job's plan are applied after the swap
    (with a reset among them), so the final state equals the stream's whole history
    materialized: by state.core.MaterializedState from the stream read over HTTP, and by the
    in-process rebuild (manage.py materialize_state --rebuild), offsets included."""
    path = f"tests/spark/appends/{time.time_ns()}"
    rng = random.Random(11)
    create_state_stream(http, path, history(rng, 30_000, keys_per_type=800))

    process = start_spark(database_url, path)
    lines: list[str] = []
    planned = threading.Event()
    published = threading.Event()

    def follow() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith("plan: "):
                planned.set()
            if line.startswith("publish: "):
                published.set()
        planned.set()  # the run ended (or failed) without them: stop waiting

    follower = threading.Thread(target=follow)
    follower.start()
    appended = 0
    batches = 0
    with httpx.Client(base_url=server.base_url, timeout=120) as writer:
        assert planned.wait(COMMAND_TIMEOUT)
        while not published.is_set() and process.poll() is None:
            batch = _appended_batch(rng, batches)
            append_ok(writer, path, batch)
            appended += len(batch)
            batches += 1
            time.sleep(0.02)  # a steady stream of writes, not a flood that slows the job
        # A few more right after the swap, racing its catch-up.
        for _ in range(3):
            append_ok(writer, path, _appended_batch(rng, batches))
            batches += 1
    process.wait(timeout=COMMAND_TIMEOUT)
    follower.join(timeout=60)
    stdout = "".join(lines)
    assert process.stderr is not None
    stderr = process.stderr.read()
    process.stderr.close()
    print(f"{batches} batches appended, {appended} messages before the swap")

    assert process.returncode == 0, stdout + stderr
    assert batches > 8  # the reset (batch 5) was appended while the job ran
    (caught_up,) = output_number(
        stdout, r"^publish: 1 streams swapped in one transaction \(\+(\d+) messages appended"
    )
    print(f"{caught_up} of them applied by the publish's catch-up")
    assert 0 < caught_up <= appended

    # Expected: the whole stream, read back over HTTP, materialized by state.core.
    messages, stream_tail = read_messages(http, path)
    expected = MaterializedState()
    expected.apply_batch(messages)
    assert len(expected) > 100
    served = entities(http, path)  # catches up anything appended after the swap
    assert {(e["type"], e["key"]): canonical(e["value"]) for e in served} == {
        (t, k): canonical(v) for t, k, v in expected.items()
    }
    after_spark = db_entities(pg, path)
    registration = db_registration(pg, path)
    assert registration.materialized_offset == stream_tail == tail(http, path)
    assert registration.invalid_events == 0

    rebuilt = manage(database_url, "materialize_state", "--rebuild", "--stream", path)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    reference: set[Entity] = db_entities(pg, path)
    assert after_spark == reference
    assert db_registration(pg, path) == registration


def _appended_batch(rng: random.Random, index: int) -> list[Any]:
    """Valid changes to existing and new keys; batch 5 starts with a reset."""
    batch: list[Any] = [control("reset")] if index == 5 else []
    for i in range(40):
        type_name = rng.choice(TYPES)
        key = f"{type_name}-{rng.randrange(1000)}"
        op = rng.choice(["insert", "update", "update", "delete"])
        value = {"name": f"appended {index}.{i}"} if op != "delete" else None
        batch.append(change(type_name, key, value, op))
    return batch
