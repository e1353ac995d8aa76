"""Fixtures of the subscription tests that need servers of their own: every server process of
a database takes part in delivering its wakes, so a test that stops, restarts or kills the
servers delivering (or needs only production servers to deliver) runs them on a database of
its own, where the session's shared server is not."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.conftest import ServerProcess, manage

StartServer = Callable[..., ServerProcess]


@pytest.fixture(scope="module")
def own_database(database_url: str) -> Iterator[str]:
    """A database of the module's own in the test cluster, migrated like the shared one, and
    dropped at the end."""
    name = f"subs_{os.getpid()}_{time.time_ns()}"
    params = conninfo_to_dict(database_url)
    admin = make_conninfo(**{**params, "dbname": "postgres"})
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = database_url.rsplit("/", 1)[0] + f"/{name}"
    migrated = manage(url, "migrate", "--no-input", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr
    yield url
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def own_servers(own_database: str, tmp_path: Path) -> Iterator[StartServer]:
    """Factory: ``own_servers(env={...}, workers=1)`` starts a server (uvicorn) on the
    module's database; all are stopped at the end of the test."""
    started: list[ServerProcess] = []

    def start(env: dict[str, str | None] | None = None, workers: int = 1) -> ServerProcess:
        log = tmp_path / f"server-{len(started)}.log"
        server = ServerProcess(own_database, env or {}, log, "uvicorn", workers)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def query(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()
