"""Test harness: a throwaway PostgreSQL database and real server processes.

pytest-django creates the test database (``test_<name>``) on the configured server, or on the
project's own local cluster when ``DATABASE_URL`` is unset, and migrates it. Server fixtures
start the production server command (uvicorn) against that database on a free port, and the
tests talk to it over real HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, settings

# Property tests run on shared, sometimes busy machines (CI, 2 cores): no per-example deadline
# and no "input generation is slow" verdicts, which measure the machine, not the code.
settings.register_profile(
    "durable-streams", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("durable-streams")

ROOT = Path(__file__).resolve().parent.parent
JS_DIR = ROOT / "tests" / "js"  # the Node packages and scripts the tests drive

# Settings every test server gets: short long-polls (the conformance suite needs < 4 s).
TEST_SERVER_ENV = {
    "DS_SERVER__LONG_POLL_TIMEOUT_SECS": "2",
    "DS_SERVER__SSE_RECONNECT_INTERVAL_SECS": "60",
    "DS_LOG_LEVEL": "WARNING",
    "DJANGO_DEBUG": "false",
    "DJANGO_SECRET_KEY": "test-servers-secret-key-not-for-production",
    # Access control is tested on its own (tests/access); elsewhere everyone may do anything.
    "DS_AUTH__MODE": "open",
    # The tests' webhook receivers (and the conformance suite's) listen on 127.0.0.1; the
    # refusal of loopback webhooks is tested with servers without this (tests/subscriptions).
    "DS_SUBSCRIPTIONS__ALLOW_LOOPBACK_WEBHOOKS": "true",
    # Every server of the session shares one __registry__, which compacts past this many new
    # events: not under tests that read its history (tests/state/test_compaction.py asks).
    "DS_STATE__COMPACTION_MIN_EVENTS": "1000000",
}


def command_env(database_url: str, **overrides: str | None) -> dict[str, str]:
    """The environment of a management command run against the test database; an override
    of None removes the variable."""
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONUNBUFFERED": "1"}
    # The test servers' secret: what commands sign (read URLs), servers can check.
    env["DJANGO_SECRET_KEY"] = TEST_SERVER_ENV["DJANGO_SECRET_KEY"]
    env.pop("DJANGO_SETTINGS_MODULE", None)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def manage(
    database_url: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``python manage.py ARGS`` in the project directory, against the test database (or
    with ``env``); never raises on failure."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env or command_env(database_url),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


ADMIN_PASSWORD = "correct-horse-battery-staple"


def create_superuser(database_url: str, username: str) -> None:
    """A new superuser ``username`` whose password is ADMIN_PASSWORD."""
    created = manage(
        database_url, "createsuperuser", "--noinput", "--username", username,
        "--email", "admin@example.com",
        env=command_env(database_url, DJANGO_SUPERUSER_PASSWORD=ADMIN_PASSWORD),
    )  # fmt: skip
    assert created.returncode == 0, created.stderr


@contextlib.contextmanager
def admin_session(
    base_url: str, database_url: str, username: str, timeout: float = 30
) -> Iterator[httpx.Client]:
    """A new superuser ``username``, logged in through the admin's form; the client follows
    redirects."""
    create_superuser(database_url, username)
    with httpx.Client(base_url=base_url, timeout=timeout, follow_redirects=True) as client:
        login_page = client.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login_page.text)
        assert token is not None
        response = client.post(
            "/admin/login/?next=/admin/",
            data={"csrfmiddlewaretoken": token.group(1), "username": username,
                  "password": ADMIN_PASSWORD},
            headers={"Referer": f"{base_url}/admin/login/"},
        )  # fmt: skip
        assert response.status_code == 200 and "Log out" in response.text
        yield client


def run_node(script: Path, *args: str, timeout: float = 90) -> Any:
    """Run a Node script of tests/js; it must exit 0 and print its report as JSON on its last
    line of output, which is returned."""
    node = shutil.which("node")
    assert node is not None, "node is not on PATH"
    result = subprocess.run(
        [node, str(script), *args], cwd=JS_DIR, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (
        f"{script.name} exited {result.returncode}\n"
        f"stderr:\n{result.stderr[-4000:]}\nstdout:\n{result.stdout[-2000:]}"
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One server process: ``base_url`` is ``http://127.0.0.1:<port>``."""

    def __init__(
        self,
        url: str,
        env: dict[str, str | None],
        log_path: Path,
        kind: str,
        workers: int = 1,
        uvicorn_args: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        environment = {**os.environ, **TEST_SERVER_ENV, **env, "DATABASE_URL": url}
        # An override of None removes the variable (a default under test).
        environment = {name: value for name, value in environment.items() if value is not None}
        if kind == "uvicorn":
            argv = [
                sys.executable, "-m", "uvicorn", "durable_project.asgi:application",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--loop", "uvloop", "--http", "durable_project.protocol:HttpToolsProtocol",
                "--no-access-log",
                *(["--workers", str(workers)] if workers > 1 else []),
                *uvicorn_args,
            ]  # fmt: skip
        elif kind == "runserver":
            argv = [
                sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{self.port}",
            ]  # fmt: skip
        else:
            raise ValueError(kind)
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            argv, cwd=ROOT, env=environment, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            self._wait_ready()
        except BaseException:
            # Not ready, or the run interrupted meanwhile: nobody else knows of it to stop it
            # (one was left serving for 90 minutes).
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not start: {self.log_path.read_text()[-3000:]}")

    def stream_url(self, path: str) -> str:
        return f"{self.base_url}/v1/stream/{path}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def _database_url(settings_dict: dict[str, Any]) -> str:
    user = settings_dict.get("USER") or "postgres"
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{password}@" if password else f"{user}@"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{settings_dict['NAME']}"


@pytest.fixture(scope="session")
def django_db_modify_db_settings() -> None:
    """A test database name of this run's own, so concurrent runs never share one."""
    from django.db import connections

    settings_dict = connections["default"].settings_dict
    settings_dict["TEST"]["NAME"] = f"test_{settings_dict['NAME']}_{os.getpid()}"


@pytest.fixture(scope="session")
def django_db_setup(
    django_test_environment: None, django_db_blocker: Any, django_db_modify_db_settings: None
) -> Iterator[None]:
    """Create and migrate the throwaway test database for the whole session, whether or not
    any test uses Django's ORM (pytest-django would only do it for `django_db` tests: the
    servers under test need it regardless)."""
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        databases = setup_databases(verbosity=0, interactive=False, aliases={"default"})
    yield
    with django_db_blocker.unblock():
        _end_sessions()
        teardown_databases(databases, verbosity=0)


def _end_sessions(grace: float = 3.0) -> None:
    """Let the sessions of processes the tests stopped end (a backend outlives its client for
    a moment), then end any left, saying whose: the test database cannot be dropped while
    one is open (a run ended in an error at teardown: "being accessed by other users")."""
    from django.db import connection

    name = connection.settings_dict["NAME"]
    query = (
        "SELECT pid, application_name, backend_start FROM pg_stat_activity"
        " WHERE datname = %s AND pid <> pg_backend_pid()"
    )
    deadline = time.monotonic() + grace
    with connection.cursor() as cursor:
        while True:
            cursor.execute(query, [name])
            left = cursor.fetchall()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid, application, started in left:
            print(f"ending a session left open: pid {pid}, {application!r}, since {started}")
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.fixture(scope="session")
def database_url(django_db_setup: None, django_db_blocker: Any) -> str:
    """URL of the migrated throwaway test database."""
    from django.db import connection

    return _database_url(connection.settings_dict)


# Every server the tests started, and whether the session shares it (a session-scoped fixture
# made it). The others stop when the module that started them ends (_stop_module_servers):
# left running, they piled up over a session, each with its pool, its LISTEN connection and
# its periodic work (more than 20 processes and 100 database connections a third of the way).
_SERVERS: list[tuple[ServerProcess, bool]] = []


@pytest.fixture(scope="session")
def start_server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Factory: ``start_server(env={...}, kind="uvicorn")`` starts a server process, stopped
    at the end of the module that started it, or of the session with ``shared=True`` (for
    session-scoped fixtures)."""
    from django.core.management import call_command

    # The servers run with DEBUG off, as in production: WhiteNoise serves collected files.
    call_command("collectstatic", interactive=False, verbosity=0)
    logs = tmp_path_factory.mktemp("server-logs")

    def start(
        env: dict[str, str | None] | None = None,
        kind: str = "uvicorn",
        workers: int = 1,
        *,
        shared: bool = False,
    ) -> ServerProcess:
        log = logs / f"server-{len(_SERVERS)}.log"
        server = ServerProcess(database_url, env or {}, log, kind, workers)
        _SERVERS.append((server, shared))
        return server

    yield start
    for server, _ in _SERVERS:
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def _stop_module_servers() -> Iterator[None]:
    """The servers a module started stop when it ends, but those the session shares."""
    first = len(_SERVERS)
    yield
    for server, shared in _SERVERS[first:]:
        if not shared:
            server.stop()


@pytest.fixture(scope="session")
def server(start_server: Any) -> ServerProcess:
    """The shared server most tests use."""
    return start_server(shared=True)


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        yield http


@pytest.fixture
def stream_path(request: pytest.FixtureRequest) -> str:
    """A stream path unique to this test."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)
    return f"tests/{name}-{time.time_ns()}"


@pytest.fixture(scope="session")
def pg(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A direct connection to the test database, for assertions on what is stored."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def own_database(database_url: str) -> Iterator[str]:
    """A migrated database of this test's own (its statistics count only what the test's
    server does; its settings are the test's to change)."""
    name = f"own_{os.getpid()}_{time.time_ns()}"
    admin = database_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = database_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        migrated = manage(url, "migrate", "--no-input", "-v", "0")
        assert migrated.returncode == 0, migrated.stderr
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
