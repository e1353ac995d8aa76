"""Production behaviour of the server process (issue 8): safe defaults, bounded database
connections, live readers that cost nothing while idle.

Each test names the defect it pins; all failed on commit 53fc172.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psycopg
import pytest

from tests.conftest import ROOT, ServerProcess, free_port, manage
from tests.faults.proxy import StallingProxy


def _start_bare(env: dict[str, str], workers: int = 1) -> subprocess.CompletedProcess[str]:
    """Start uvicorn with ``env`` and no settings of the test harness; it must exit by itself
    (refusing to start) within the timeout."""
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "durable_project.asgi:application",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]  # fmt: skip
    return subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def _bare_env(database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DS_"))}
    # The checkout's .env (a development checkout asks for DEBUG there) must not count.
    env |= {"DATABASE_URL": database_url, "DJANGO_ENV_FILE": "/nonexistent", **extra}
    return env


def test_without_debug_the_development_secret_key_is_refused(database_url: str) -> None:
    """Defect 3: the production command ran with DEBUG on and the development secret key.
    DEBUG is now off unless asked for, and then the server refuses to start without a
    secret key of its own, or with the development one."""
    for extra in (
        {},
        {"DJANGO_SECRET_KEY": "dev-only-insecure-key-set-DJANGO_SECRET_KEY-in-production"},
    ):
        result = _start_bare(_bare_env(database_url, **extra))
        assert result.returncode != 0
        assert "DJANGO_SECRET_KEY" in result.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DS_LIVE__MAX_PER_CLIENT", "abc"),
        ("DS_SERVER__LONG_POLL_TIMEOUT_SECS", "nan"),
        ("DS_SERVER__SSE_KEEPALIVE_SECS", "0"),
        ("DS_HTTP__HEAD_TIMEOUT_SECS", "0"),
        ("DS_READ__MAX_CHUNK_MESSAGES", "0"),
        ("DS_LIMITS__MAX_REQUEST_BYTES", "-1"),
        ("DS_LOG__FORMAT", "xml"),
        ("DS_METRICS__DIR", "/proc/nonexistent"),
        # Review: failures other than Django's own started workers for ever too, and numbers
        # past what PostgreSQL holds failed every request.
        ("DS_SERVER__MALLOC_MMAP_THRESHOLD_BYTES", "32MiB"),
        ("YJS_SERVICE_SECRETS", "abc"),
        ("DS_DB__LOCK_TIMEOUT_SECS", "2500000"),
        ("DS_LIMITS__MAX_STREAM_BYTES", "99999999999999999999"),
        ("DS_AUTH__JWT_JWKS_FILE", "/nonexistent/jwks.json"),
    ],
)
def test_a_setting_the_server_cannot_run_with_stops_it(
    database_url: str, name: str, value: str
) -> None:
    """Probe 10f: a setting of the wrong type failed each worker as it loaded, and uvicorn's
    supervisor started the next one, for ever (32 workers in 22 s, the port bound, nothing
    served); a zero or negative one was taken, then every request was refused, hung or spun
    (SSE keep-alives in a tight loop). Every number is checked at start now, and a setting the
    server cannot run with stops it, naming the setting."""
    env = _bare_env(database_url, DJANGO_SECRET_KEY="s" * 50, **{name: value})
    result = _start_bare(env, workers=2)
    assert f"refusing to start: {name}" in result.stderr, result.stderr[-2000:]
    assert "died" not in result.stderr  # no worker started again


def test_production_errors_leak_nothing_and_hosts_are_checked(server: Any) -> None:
    """Defect 3: every error on a Django-served URL was a traceback page naming the database
    host, user and source paths, for any Host. Test servers run as production does."""
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        missing = client.get("/admin/no-such-page/")
        assert missing.status_code in (302, 404)
        assert "Traceback" not in missing.text and "DATABASES" not in missing.text
        for url in ("/v1/streams", "/v1/stream/anything", "/admin/login/"):
            response = client.get(url, headers={"Host": "evil.example"})
            assert response.status_code == 400, (url, response.status_code)
            assert "Traceback" not in response.text


def _connections(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        return int(row[0])


def test_django_urls_hold_a_bounded_number_of_connections(
    own_database: str, tmp_path: Path
) -> None:
    """Defect 4: Django-served URLs kept one connection per thread that ever served them
    (CONN_MAX_AGE under ASGI): 200 concurrent clients exhausted PostgreSQL's connections and
    172 stayed open. A bounded pool serves them now: 200 concurrent requests all succeed and
    the process holds at most its pools' sizes. (A database of its own: the session's other
    servers open and close connections to theirs meanwhile.)"""
    env = {"DS_DB__DJANGO_POOL_MAX_SIZE": "4", "DS_DB__POOL_MAX_SIZE": "4"}
    server = ServerProcess(own_database, env, tmp_path / "bounded.log", "uvicorn")
    try:
        statuses, held = _two_hundred_clients(server, own_database)
    finally:
        server.stop()
    assert set(statuses) == {200}
    # Django's pool (4) + the protocol pool (4) + the LISTEN connection, at most.
    assert held <= 9, held


def _two_hundred_clients(server: ServerProcess, database_url: str) -> tuple[list[int], int]:
    """The statuses of 200 concurrent requests to Django-served URLs, and how many more
    connections the database has after them than before."""
    before = _connections(database_url)

    async def run() -> list[int]:
        async with aiohttp.ClientSession(base_url=server.base_url) as session:

            async def one(index: int) -> int:
                url = "/v1/streams" if index % 2 else "/v1/state/streams"
                async with session.get(url) as response:
                    await response.read()
                    return response.status

            return await asyncio.gather(*(one(i) for i in range(200)))

    statuses = asyncio.run(run())
    return statuses, _connections(database_url) - before


def test_idle_sse_readers_cost_no_queries(own_database: str, tmp_path: Path) -> None:
    """Defect 12: an idle SSE connection re-read the database at every keep-alive (every 15 s,
    133 queries/s at 2,000 readers). Now keep-alives are comments and nothing more: 20 idle
    readers getting a keep-alive every 0.1 s for 3 s (600 keep-alives) cause no queries. The
    server has a database of its own; over the 14 s measured its own periodic work (the LISTEN
    heartbeat and the state sweep, each every 5 s, with the pool's check of a connection idle
    for more than a second) and the measurement make a few dozen transactions at most, where a
    re-read per keep-alive would make 600. The sweeps of subscriptions (every second) and sinks
    are slowed down here: they are periodic work, not the readers'."""
    env = {
        "DS_SERVER__SSE_KEEPALIVE_SECS": "0.1",
        "DS_SUBSCRIPTIONS__SWEEP_INTERVAL_SECS": "60",
        "DS_TABLESYNC__SWEEP_INTERVAL_SECS": "60",
    }
    server = ServerProcess(own_database, env, tmp_path / "idle.log", "uvicorn")
    try:
        keepalives, queries = _idle_sse(server, own_database)
    finally:
        server.stop()
    assert keepalives == 20
    assert queries < 60, queries


def _idle_sse(server: ServerProcess, database_url: str) -> tuple[int, int]:
    path = f"tests/idle-sse-{time.time_ns()}"
    url = f"{server.base_url}/v1/stream/{path}"
    assert httpx.put(url, headers={"Content-Type": "text/plain"}).status_code == 201

    def commits() -> int:
        with psycopg.connect(database_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
            assert row is not None
            return int(row[0])

    async def run() -> tuple[int, int]:
        async with aiohttp.ClientSession() as session:
            responses = [
                await session.get(url, params={"offset": "now", "live": "sse"}) for _ in range(20)
            ]
            try:
                # Past the first reads, and past the statistics' flush of idle backends (PG 15
                # reports an idle backend's counts within 10 s, but with a delay).
                await asyncio.sleep(11)
                start = await asyncio.to_thread(commits)
                keepalives = 0
                deadline = time.monotonic() + 3
                for response in responses:
                    while time.monotonic() < deadline:
                        line = await asyncio.wait_for(response.content.readline(), 5)
                        if line.startswith(b": keep-alive"):
                            keepalives += 1
                            break
                await asyncio.sleep(max(0.0, deadline - time.monotonic()) + 11)
                end = await asyncio.to_thread(commits)
                return keepalives, end - start
            finally:
                for response in responses:
                    response.close()

    return asyncio.run(run())


@pytest.mark.parametrize("live", ["long-poll", "sse"])
def test_readers_of_a_draining_process_end_at_once(start_server: Any, live: str) -> None:
    """Defect 9 (in part; the fault suite covers the whole): SIGTERM waited for SSE clients to
    leave (forever with the reconnect interval at 0) and did not end long-polls. Now the
    process ends its live readers at once and exits."""
    server = start_server(
        env={
            "DS_SERVER__LONG_POLL_TIMEOUT_SECS": "60",
            "DS_SERVER__SSE_RECONNECT_INTERVAL_SECS": "0",
        }
    )
    url = server.stream_url(f"tests/drain-{live}-{time.time_ns()}")
    assert httpx.put(url, headers={"Content-Type": "text/plain"}).status_code == 201

    async def run() -> tuple[int, bytes, float]:
        async with aiohttp.ClientSession() as session:
            response = await session.get(url, params={"offset": "now", "live": live})
            await asyncio.sleep(0.5)
            started = time.monotonic()
            server.process.terminate()
            body = await asyncio.wait_for(response.read(), 20)
            return response.status, body, time.monotonic() - started

    status, body, seconds = asyncio.run(run())
    if live == "long-poll":
        assert status == 204
    else:
        assert status == 200 and b"event: control" in body
    server.process.wait(timeout=20)
    assert seconds < 15


@pytest.fixture
def unmigrated_database(database_url: str) -> Iterator[str]:
    """An empty database, never migrated."""
    name = f"bare_{os.getpid()}_{time.time_ns()}"
    admin = database_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_database_checked_late_is_checked_all_the_same(
    unmigrated_database: str, tmp_path: Path
) -> None:
    """Probe 10f: a server started while its database was unreachable checks the database's
    SQL once it answers; when that database had never been migrated, the check's error ended
    it silently, and the process answered 500 to every request while /readyz said 200. It is
    not ready until the check is made, answers no 500 meanwhile, and refuses to serve (it
    stops) once it finds the database is not its code's."""
    host_port = unmigrated_database.split("@", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    proxy = StallingProxy(host, free_port()).start()  # a port nobody listens on, at first
    try:
        env = {"DS_DB__SOCKET_DIR": "", "DS_DB__ACQUIRE_TIMEOUT_SECS": "1"}
        through_proxy = unmigrated_database.replace(host_port, f"127.0.0.1:{proxy.port}")
        server = ServerProcess(through_proxy, env, tmp_path / "late.log", "uvicorn")
        statuses: set[int] = set()
        with httpx.Client(timeout=10) as http:
            ready = http.get(f"{server.base_url}/readyz")
            assert ready.status_code == 503 and ready.json()["schema"] != "ok", ready.text
            proxy.target = (host, int(port))  # the database answers from now on
            deadline = time.monotonic() + 60
            while server.process.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(httpx.TransportError):
                    put = http.put(
                        server.stream_url("late/x"), headers={"Content-Type": "text/plain"}
                    )
                    statuses.add(put.status_code)
                time.sleep(0.2)
        assert server.process.poll() is not None, "still serving a database never migrated"
        assert 500 not in statuses, statuses
        log = (tmp_path / "late.log").read_text()
        assert "refusing to serve" in log
        # Its refusal's the only traceback: no background work ran against that database
        # (review: subscription wakes and table sync met it with theirs).
        assert log.count("Traceback") == 1, log[-3000:]
        server.stop()
    finally:
        proxy.stop()


def test_a_request_cut_short_by_a_stopping_server_is_a_503(
    database_url: str, tmp_path: Path
) -> None:
    """Probe 10f: a request still running when ``--timeout-graceful-shutdown`` passed (here a
    POST whose body was still arriving) was cancelled by uvicorn, which answered 500 and
    logged a traceback. It is answered 503 (retry), and nothing of it is stored. An append
    whose body had arrived may be in a transaction already (here waiting for a row another
    session holds), to commit after the process is gone: it is not told to retry (review)."""
    server = ServerProcess(database_url, {}, tmp_path / "stopping.log", "uvicorn",
                           uvicorn_args=("--timeout-graceful-shutdown", "1"))  # fmt: skip
    path, held = f"stopping/{time.time_ns()}", f"stopping/held-{time.time_ns()}"
    for name in (path, held):
        created = httpx.put(server.stream_url(name), headers={"Content-Type": "text/plain"})
        assert created.status_code == 201
    head = "HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
    with (
        psycopg.connect(database_url) as locker,
        socket.create_connection(("127.0.0.1", server.port), timeout=20) as arriving,
        socket.create_connection(("127.0.0.1", server.port), timeout=20) as first,
        socket.create_connection(("127.0.0.1", server.port), timeout=20) as queued,
    ):
        locker.execute("SELECT 1 FROM ds_stream WHERE path = %s FOR UPDATE", (held,))
        arriving.sendall(
            f"POST /v1/stream/{path} {head}Content-Length: 100000\r\n\r\nthe start".encode()
        )
        for sock in (first, queued):  # the first waits for the row, the second behind it
            sock.sendall(f"POST /v1/stream/{held} {head}Content-Length: 5\r\n\r\nwhole".encode())
            time.sleep(0.25)
        server.process.terminate()
        answers = [_read_to_end(sock) for sock in (arriving, first, queued)]
        server.process.wait(timeout=30)
        locker.rollback()
    assert answers[0].startswith(b"HTTP/1.1 503"), answers[0][:300]
    assert b"retry-after:" in answers[0].lower()
    for answer in answers[1:]:
        assert not answer.startswith(b"HTTP/1.1 503"), answer[:300]
    with psycopg.connect(database_url) as conn:
        stored = conn.execute("SELECT next_seq FROM ds_stream WHERE path = %s", (path,))
        assert stored.fetchone() == (0,)


def _read_to_end(sock: socket.socket) -> bytes:
    answer = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_process_started_without_its_database_is_live_without_waiting_for_it(
    own_database: str, tmp_path: Path
) -> None:
    """Probe 10f: started while the database was unreachable, a process waited 5 s for its
    schema check and then up to 5 s more for its LISTEN connection before it answered
    anything, ``/healthz`` included (a liveness probe with a short timeout restarts such a
    process). Once the check has found the database unreachable it no longer waits for the
    LISTEN connection: when ``/healthz`` first answers, that connection has been tried only
    once or twice (seven times, after waiting the 5 s, before)."""
    host_port = own_database.split("@", 1)[1].split("/", 1)[0]
    proxy = StallingProxy("127.0.0.1", free_port()).start()  # a port nobody listens on
    try:
        env = {"DS_DB__SOCKET_DIR": ""}
        through_proxy = own_database.replace(host_port, f"127.0.0.1:{proxy.port}")
        server = ServerProcess(through_proxy, env, tmp_path / "unreachable.log", "uvicorn")
        try:
            metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        finally:
            server.stop()
    finally:
        proxy.stop()
    tries = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('ds_listen_reconnects_total{reason="error"}')
    ]
    # Tried at 0, 0.1, 0.3, 0.7, 1.5 s...: 1-2 times by the first answer here, 7 before.
    assert sum(tries) <= 5, tries


def test_a_database_whose_sql_another_version_replaced_is_not_served(
    own_database: str, tmp_path: Path
) -> None:
    """Probe 10u: an older version's ``migrate`` (a rollback, or what its refusal to start
    advised) installed its SQL under this version's running servers, which went on serving
    with the older rules (a state stream's trim deleted its history again). A process stops
    within seconds of its database's SQL ceasing to be its code's, refusing requests
    meanwhile; and this version's ``migrate`` leaves alone the SQL of a database a newer
    version migrated."""
    server = ServerProcess(own_database, {}, tmp_path / "replaced.log", "uvicorn")
    try:
        with psycopg.connect(own_database, autocommit=True) as conn:
            (ours,) = conn.execute("SELECT digest FROM ds_sql_install").fetchone()
            # What another version's migrate leaves: its SQL, its digest.
            conn.execute("UPDATE ds_sql_install SET digest = 'another version'")
            deadline = time.monotonic() + 30
            while server.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert server.process.poll() is not None, "still serving another version's SQL"
            log = (tmp_path / "replaced.log").read_text()
            assert "the database changed under this process" in log, log[-2000:]
            conn.execute("UPDATE ds_sql_install SET digest = %s", [ours])
            # A newer version's migration recorded: this version's migrate refuses, and
            # installs nothing.
            conn.execute(
                "INSERT INTO django_migrations (app, name, applied)"
                " VALUES ('streams', '9999_from_a_newer_version', now())"
            )
            conn.execute("UPDATE ds_sql_install SET digest = 'a newer version'")
            migrated = manage(own_database, "migrate", "--no-input", "-v", "0")
            assert migrated.returncode != 0
            assert "migrated by a newer version" in migrated.stderr, migrated.stderr[-2000:]
            assert "streams.9999_from_a_newer_version" in migrated.stderr
            (digest,) = conn.execute("SELECT digest FROM ds_sql_install").fetchone()
            assert digest == "a newer version"
    finally:
        server.stop()
