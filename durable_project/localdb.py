"""A private PostgreSQL cluster for development and tests.

Used only when ``DATABASE_URL`` is unset (DESIGN.md: "PostgreSQL everywhere, started by the
project"). The cluster lives in ``.pgdata/`` at the repository root (git-ignored), listens on
127.0.0.1 only (TCP, because Spark's JDBC driver cannot use Unix sockets), on a port picked once
and remembered in ``.pgdata/port`` so two checkouts on one machine do not collide.

``initdb`` refuses to run as root, so as root every PostgreSQL binary runs as the ``postgres`` OS
user through ``runuser``. Everything here is idempotent and guarded by a file lock, because the
runserver autoreloader, several test workers and ``make`` may all call it at once.

Command line: ``python -m durable_project.localdb {start|stop|url|status}``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
PGDATA_ROOT = Path(os.environ.get("DS_LOCAL_PG_DIR", BASE_DIR / ".pgdata"))
CLUSTER_DIR = PGDATA_ROOT / "cluster"
PORT_FILE = PGDATA_ROOT / "port"
LOCK_FILE = PGDATA_ROOT / ".lock"
LOG_FILE = PGDATA_ROOT / "postgres.log"
DATABASE_NAME = "durable_streams"
FIRST_PORT = 54329

# Settings for a developer's cluster. Durability stays at PostgreSQL's defaults (fsync and
# synchronous_commit on): benchmarks run against this cluster and must measure durable appends.
SERVER_OPTIONS = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "max_connections": "300",
    "shared_buffers": "256MB",
}


class LocalDatabaseError(RuntimeError):
    """The local cluster could not be prepared; the message says what to install or check."""


def _bindir() -> Path:
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
    if candidates:
        return candidates[-1].parent
    raise LocalDatabaseError(
        "PostgreSQL server binaries not found: install them (Debian: apt-get install postgresql) "
        "or set DATABASE_URL to an existing database."
    )


def _as_cluster_owner(argv: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *argv]
    return argv


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        _as_cluster_owner(argv), capture_output=True, text=True, check=False, cwd="/"
    )
    if result.returncode != 0:
        raise LocalDatabaseError(
            f"{Path(argv[0]).name} failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    PGDATA_ROOT.mkdir(parents=True, exist_ok=True)
    with LOCK_FILE.open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port() -> int:
    if PORT_FILE.exists():
        return int(PORT_FILE.read_text().strip())
    port = next(p for p in range(FIRST_PORT, FIRST_PORT + 500) if _port_is_free(p))
    PORT_FILE.write_text(f"{port}\n")
    return port


def _initdb() -> None:
    if (CLUSTER_DIR / "PG_VERSION").exists():
        return
    CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(CLUSTER_DIR, user="postgres", group="postgres")
        CLUSTER_DIR.chmod(0o700)
    _run(
        [
            str(_bindir() / "initdb"),
            "-D",
            str(CLUSTER_DIR),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-instructions",
        ]
    )


def _is_running(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _socket_directory(port: int) -> Path | None:
    """Where the cluster also listens on a Unix socket: the data folder, unless its path is too
    long for a socket's address (108 bytes)."""
    socket = PGDATA_ROOT.resolve() / f".s.PGSQL.{port}"
    return PGDATA_ROOT.resolve() if len(str(socket).encode()) < 100 else None


def _start(port: int) -> None:
    if _is_running(port):
        return
    if not _port_is_free(port):
        raise LocalDatabaseError(f"port {port} (from {PORT_FILE}) is taken by another program")
    if os.geteuid() == 0:
        LOG_FILE.touch()
        shutil.chown(LOG_FILE, user="postgres", group="postgres")
    socket_dir = _socket_directory(port)
    if socket_dir is not None and os.geteuid() == 0:
        shutil.chown(socket_dir, user="postgres")
    options = " ".join(
        f"-c {k}={v!r}" if v == "" else f"-c {k}={v}"
        for k, v in (SERVER_OPTIONS | {"unix_socket_directories": str(socket_dir or "")}).items()
    )
    _run(
        [
            str(_bindir() / "pg_ctl"),
            "-D",
            str(CLUSTER_DIR),
            "-l",
            str(LOG_FILE),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {port} {options}",
            "start",
        ]
    )
    deadline = time.monotonic() + 30
    while not _is_running(port):
        if time.monotonic() > deadline:
            raise LocalDatabaseError(f"PostgreSQL did not accept connections; see {LOG_FILE}")
        time.sleep(0.1)


def _ensure_database(port: int, name: str) -> None:
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True
    ) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def url(port: int | None = None, name: str = DATABASE_NAME) -> str:
    return f"postgres://postgres@127.0.0.1:{port or _port()}/{name}"


def socket_directory() -> str | None:
    """The directory of the running cluster's Unix socket, if it has one (a cluster started
    by an older checkout listens on TCP only). The server's own connections prefer it
    (settings: DS_DB__SOCKET_DIR): a statement over loopback TCP costs the server more CPU."""
    if not PORT_FILE.exists():
        return None
    port = _port()
    directory = _socket_directory(port)
    if directory is None or not (directory / f".s.PGSQL.{port}").exists():
        return None
    return str(directory)


def ensure_running() -> str:
    """Start the local cluster if needed and return the URL of the project database."""
    with _locked():
        _initdb()
        port = _port()
        _start(port)
        _ensure_database(port, DATABASE_NAME)
    return url(port)


def stop() -> None:
    with _locked():
        if (CLUSTER_DIR / "postmaster.pid").exists():
            _run(
                [
                    str(_bindir() / "pg_ctl"),
                    "-D",
                    str(CLUSTER_DIR),
                    "-m",
                    "fast",
                    "stop",
                ]
            )


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "start"
    try:
        if command == "start":
            print(ensure_running())
        elif command == "url":
            print(url())
        elif command == "stop":
            stop()
        elif command == "status":
            running = PORT_FILE.exists() and _is_running(_port())
            print("running" if running else "stopped")
            return 0 if running else 3
        else:
            print(f"usage: {argv[0]} start|stop|url|status", file=sys.stderr)
            return 2
    except LocalDatabaseError as exc:
        print(f"local PostgreSQL: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
