"""The processes the fault suite breaks: a PostgreSQL cluster of its own and uvicorn servers.

``PgCluster`` is a throwaway cluster (initdb in a temporary directory, a free port on
127.0.0.1) that the tests may stop (fast or immediate mode) and start again; it is never the
shared test database nor the project's ``.pgdata`` cluster. As root, PostgreSQL binaries run as
the ``postgres`` OS user (initdb refuses root), as ``durable_project.localdb`` does.

``Server`` runs the production command (uvicorn, ``--workers N``, uvloop, httptools,
``--timeout-graceful-shutdown 10``) in a process group of its own, so the test can kill -9 one
worker, or every process of the server at once, and start it again on the same port.

The server code comes from ``FAULTS_SERVER_ROOT`` when set (another checkout, such as an older
commit, with the same virtualenv), else from this checkout: the suite can prove that a fault
it checks was broken before.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[2]
SERVER_ROOT = Path(os.environ.get("FAULTS_SERVER_ROOT") or ROOT).resolve()

# The environment of every server and management command (as tests/conftest.py's servers).
SERVER_ENV = {
    "DJANGO_DEBUG": "false",
    "DJANGO_SECRET_KEY": "fault-suite-secret-key-not-for-production",
    "DS_LOG_LEVEL": "WARNING",
    "PYTHONUNBUFFERED": "1",
    # Access control is tested on its own (tests/access).
    "DS_AUTH__MODE": "open",
}
DATABASE_NAME = "ds_faults"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    condition: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> float:
    """Poll ``condition`` until it is true; the seconds it took. Fails after ``timeout``."""
    started = time.monotonic()
    while True:
        if condition():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _pg_bindir() -> Path:
    configured = os.environ.get("DS_PG_BINDIR")
    if configured:
        return Path(configured)
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if not candidates:
        raise RuntimeError("PostgreSQL server binaries not found (apt-get install postgresql)")
    return candidates[-1].parent


class PgCluster:
    """A PostgreSQL cluster in a temporary directory that the fault tests own."""

    def __init__(self) -> None:
        self.bindir = _pg_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="ds-faults-pg-"))
        self.root.chmod(0o755)  # the postgres user must reach the data directory
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/{DATABASE_NAME}"
        self.admin_url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        self._as_root = os.geteuid() == 0
        self.data.mkdir(mode=0o700)
        self.log.touch()
        if self._as_root:
            shutil.chown(self.data, user="postgres", group="postgres")
            shutil.chown(self.log, user="postgres", group="postgres")

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / argv[0]), *argv[1:]]
        if self._as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, cwd="/"
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{argv[0]} failed ({result.returncode}): {result.stderr.strip()}\n"
                f"{self.log_tail()}"
            )
        return result

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def create(self, server_root: Path) -> None:
        """initdb, start, create the database and migrate it with ``server_root``'s code."""
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
            "--locale=C.UTF-8", "--no-instructions",
        )  # fmt: skip
        self.start()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{DATABASE_NAME}"')
        migrated = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"],
            cwd=server_root,
            env={**os.environ, **SERVER_ENV, "DATABASE_URL": self.url},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if migrated.returncode != 0:
            raise RuntimeError(f"migrate failed:\n{migrated.stderr[-4000:]}")

    def start(self) -> float:
        """Start the cluster and wait until it accepts connections; the seconds it took."""
        started = time.monotonic()
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
            "-c max_connections=200"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "120",
            "-o", options, "start",
        )  # fmt: skip
        wait_for(self.accepts_connections, 60, "PostgreSQL to accept connections")
        return time.monotonic() - started

    def stop(self, mode: str = "fast") -> float:
        """``pg_ctl stop -m MODE`` (fast: clients are disconnected, a clean shutdown;
        immediate: every process quits at once, recovery at the next start); the seconds it
        took."""
        started = time.monotonic()
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop")
        return time.monotonic() - started

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def accepts_connections(self) -> bool:
        try:
            with psycopg.connect(self.admin_url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def ensure_running(self) -> None:
        if not self.accepts_connections():
            if self.running:
                with contextlib.suppress(RuntimeError):
                    self.stop("immediate")
            self.start()

    def destroy(self) -> None:
        if self.running:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def _processes(field: int, value: int) -> list[int]:
    """Live process ids whose /proc stat field (after the command name: 1 ppid, 2 process
    group) is ``value``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[field]) == value:
            found.append(int(entry.name))
    return sorted(found)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """Is process ``pid`` running (not gone, not a zombie)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _children(pid: int) -> list[int]:
    return _processes(1, pid)


def _group(pgid: int) -> list[int]:
    return _processes(2, pgid)


class Server:
    """One server: the production uvicorn command with ``workers`` worker processes."""

    STARTUP_LINE = "Application startup complete."

    def __init__(
        self,
        database_url: str,
        log_dir: Path,
        name: str,
        *,
        workers: int = 2,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.database_url = database_url
        self.name = name
        self.workers = workers
        self.env = dict(env or {})
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def stream_url(self, path: str) -> str:
        return f"{self.base_url}/v1/stream/{path}"

    def start(self, wait: bool = True) -> float:
        """Start the server (on the same port as before, if it ran before); the seconds until
        every worker finished its start-up, when ``wait``."""
        assert self.process is None or self.process.poll() is not None, "already running"
        started = time.monotonic()
        argv = [
            sys.executable, "-m", "uvicorn", "durable_project.asgi:application",
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(self.workers),
            "--loop", "uvloop", "--http", "durable_project.protocol:HttpToolsProtocol",
            "--no-access-log",
            "--timeout-graceful-shutdown", "10",
        ]  # fmt: skip
        environment = {**os.environ, **SERVER_ENV, **self.env, "DATABASE_URL": self.database_url}
        environment.pop("DJANGO_SETTINGS_MODULE", None)
        self._lines_before = self.startup_count()
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts} ---\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                argv, cwd=SERVER_ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.starts += 1
        if wait:
            self.wait_started(self._lines_before + self.workers)
        return time.monotonic() - started

    def startup_count(self) -> int:
        """How many worker start-ups the log reports so far."""
        try:
            return self.log_path.read_text(errors="replace").count(self.STARTUP_LINE)
        except OSError:
            return 0

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_started(self, startups: int, timeout: float = 60) -> None:
        def ready() -> bool:
            if self.process is None or self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited:\n{self.log_tail()}")
            return self.startup_count() >= startups and self._healthy()

        wait_for(ready, timeout, f"{self.name} to start", interval=0.1)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def worker_pids(self) -> list[int]:
        """The worker processes (the master's other child is multiprocessing's resource
        tracker)."""
        return [pid for pid in _children(self.pid) if b"spawn_main" in _cmdline(pid)]

    def group_pids(self) -> list[int]:
        return [self.pid, *self.worker_pids()]

    def kill_worker(self, index: int = 0) -> tuple[int, float]:
        """kill -9 one worker; the master replaces it. Returns the pid killed and the seconds
        until its replacement finished its start-up."""
        workers = self.worker_pids()
        assert len(workers) == self.workers, f"{self.name} workers: {workers}"
        victim = workers[index % len(workers)]
        startups = self.startup_count()
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        self.wait_started(startups + 1)
        return victim, time.monotonic() - killed_at

    def kill_all(self) -> None:
        """kill -9 every process of the server at once (the master and its workers)."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        wait_for(lambda: not _group(self.pid), 30, f"every process of {self.name} to go")

    def terminate(self) -> None:
        """SIGTERM to the master (what an orchestrator sends)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Stop the server if it runs: SIGTERM, then SIGKILL to its process group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


def log_errors(text: str) -> list[str]:
    """Lines of a server log that report a request failing unexpectedly (what became, or
    would have become, a 500): the protocol endpoints' errors and uvicorn's crashes."""
    return [
        line
        for line in text.splitlines()
        if re.search(r"\bERROR (streams|yjs)\.|Exception in ASGI application", line)
    ]
