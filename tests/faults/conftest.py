"""Fixtures of the fault suite: a PostgreSQL cluster of its own, servers it may kill, figures.

How hard the suite pushes is set by the environment: ``FAULTS_KILL_CYCLES`` (kill -9 cycles,
default 2) and ``FAULTS_PG_RESTARTS`` (PostgreSQL restarts under load, default 1) are the short
version ``make test`` runs; ``make test-faults`` runs 20 and 3. ``FAULTS_REPORT`` names a file
that receives every figure as a JSON line. ``FAULTS_SERVER_ROOT`` runs the servers from another
checkout (tests/faults/processes.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.faults.processes import SERVER_ROOT, PgCluster, Server

KILL_CYCLES = int(os.environ.get("FAULTS_KILL_CYCLES", "2"))
PG_RESTARTS = int(os.environ.get("FAULTS_PG_RESTARTS", "1"))

Report = Callable[..., None]
StartServer = Callable[..., Server]


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """A throwaway PostgreSQL cluster, created and migrated once for the fault suite, and
    removed at the end (never the shared test database or the project's .pgdata)."""
    cluster = PgCluster()
    try:
        cluster.create(SERVER_ROOT)
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def cluster(pg_cluster: PgCluster) -> Iterator[PgCluster]:
    """The suite's cluster, running at the start and at the end of the test."""
    pg_cluster.ensure_running()
    yield pg_cluster
    pg_cluster.ensure_running()


@pytest.fixture
def servers(cluster: PgCluster, tmp_path: Path) -> Iterator[StartServer]:
    """Factory: ``servers(name, workers=2, env={...})`` starts a server on the suite's cluster;
    every server is stopped at the end of the test (logs in the test's tmp_path)."""
    started: list[Server] = []

    def start(
        name: str,
        *,
        workers: int = 2,
        env: Mapping[str, str] | None = None,
        database_url: str | None = None,
    ) -> Server:
        server = Server(database_url or cluster.url, tmp_path, name, workers=workers, env=env)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Report:
    """``report(key=value, ...)``: print a line of figures (shown with ``-s``) and append it to
    ``FAULTS_REPORT`` when set."""
    name = request.node.name

    def emit(**figures: Any) -> None:
        text = " ".join(f"{key}={_show(value)}" for key, value in figures.items())
        print(f"\n[faults] {name}: {text}", flush=True)
        destination = os.environ.get("FAULTS_REPORT")
        if destination:
            with Path(destination).open("a") as out:
                out.write(json.dumps({"test": name, **figures}, default=str) + "\n")

    return emit


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, dict):
        return json.dumps(value, default=str, separators=(",", ":"))
    return str(value)
