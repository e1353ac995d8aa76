"""Idle SSE load check: one server process holds many idle SSE readers, cheaply.

    python bench/sse_idle_load.py [--connections 10000] [--streams 4] [--hold 60] [--baseline 60]

What it does, all on 127.0.0.1 and bounded in time:

1. Makes a throwaway database on the configured PostgreSQL (``DATABASE_URL``, else the
   project's local cluster), migrates it, and starts ONE uvicorn process (one worker) on it,
   with its file-descriptor limit raised (``prlimit --nofile``) and SSE connections never
   ended by the server (``DS_SERVER__SSE_RECONNECT_INTERVAL_SECS=0``).
2. Baseline: with no reader connected, counts the test database's committed transactions
   (``xact_commit`` + ``xact_rollback`` in ``pg_stat_database``) over ``--baseline`` seconds:
   the server's own periodic work (LISTEN heartbeat, expiry and state sweeps).
3. Opens ``--connections`` SSE readers (``live=sse&offset=now``) spread over ``--streams``
   streams, from several client processes (asyncio, raw sockets), each with its own raised
   descriptor limit; every reader must get its first control event (``upToDate``).
4. Holds them idle for ``--hold`` seconds and counts the database's transactions again: the
   goal is that idle readers cause none beyond the baseline.
5. Counts the connections still open, measures server RSS, appends one message to every
   stream, and counts the readers that receive it (within 60 s).

It prints a report and exits non-zero if a connection failed or a message was not delivered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONNECT_CONCURRENCY = 100  # connection attempts in flight per client process
DELIVERY_TIMEOUT = 60.0
STATS_SETTLE_SECS = 11.0  # PostgreSQL's PGSTAT_IDLE_INTERVAL (10 s), and a margin


# -- the client side ---------------------------------------------------------------------------


@dataclass
class Reader:
    open: bool = False
    got_data: bool = False
    failed: str | None = None


def _raise_fd_limit() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 65536
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return wanted


async def _read_reader(
    reader: Reader, port: int, path: str, started: asyncio.Event, stop: asyncio.Event
) -> None:
    try:
        stream_r, stream_w = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), timeout=30
        )
    except (OSError, TimeoutError) as exc:
        reader.failed = f"connect: {exc!r}"
        started.set()
        return
    try:
        stream_w.write(
            f"GET /v1/stream/{path}?offset=now&live=sse HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        await stream_w.drain()
        buffer = b""
        while b"upToDate" not in buffer:
            chunk = await asyncio.wait_for(stream_r.read(65536), timeout=60)
            if not chunk:
                reader.failed = f"closed before the first control event: {buffer[:200]!r}"
                return
            buffer += chunk
        if not buffer.startswith(b"HTTP/1.1 200"):
            reader.failed = f"status: {buffer[:100]!r}"
            return
        reader.open = True
        started.set()
        buffer = b""
        while not stop.is_set():
            chunk = await stream_r.read(65536)
            if not chunk:
                reader.open = False
                return
            buffer = (buffer + chunk)[-4096:]
            if b"event: data" in buffer:
                reader.got_data = True
                buffer = b""
    except (OSError, TimeoutError) as exc:
        reader.failed = reader.failed or repr(exc)
        reader.open = False
    finally:
        started.set()
        stream_w.close()


def client_process(port: int, paths: list[str], count: int, first: int, pipe: Connection) -> None:
    """Hold ``count`` readers; answer the parent's commands ("status", "stop") over ``pipe``."""
    _raise_fd_limit()
    asyncio.run(_client_main(port, paths, count, first, pipe))


async def _client_main(
    port: int, paths: list[str], count: int, first: int, pipe: Connection
) -> None:
    loop = asyncio.get_running_loop()
    readers = [Reader() for _ in range(count)]
    stop = asyncio.Event()
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
    tasks = []

    async def start(index: int) -> None:
        async with gate:
            started = asyncio.Event()
            path = paths[(first + index) % len(paths)]
            tasks.append(
                asyncio.create_task(_read_reader(readers[index], port, path, started, stop))
            )
            await started.wait()

    await asyncio.gather(*(start(i) for i in range(count)))
    pipe.send({"established": sum(r.open for r in readers)})
    while True:
        command = await loop.run_in_executor(None, pipe.recv)
        if command == "stop":
            break
        failures = [r.failed for r in readers if r.failed]
        pipe.send(
            {
                "open": sum(r.open for r in readers),
                "got_data": sum(r.got_data for r in readers),
                "failed": len(failures),
                "failure_sample": failures[:3],
            }
        )
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    pipe.send({"stopped": True})


# -- the server side ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def database_urls() -> tuple[str, str, str]:
    """(admin URL on the ``postgres`` database, test database URL, test database name)."""
    base = os.environ.get("DATABASE_URL")
    if not base:
        from durable_project import localdb

        base = localdb.ensure_running()
    name = f"sse_load_{os.getpid()}"
    prefix = base.rsplit("/", 1)[0]
    return f"{prefix}/postgres", f"{prefix}/{name}", name


def transactions(admin_url: str, name: str) -> int:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (name,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def count_window(admin_url: str, name: str, seconds: float) -> tuple[int, float]:
    """Transactions of the test database over ``seconds``. PostgreSQL (15+) publishes an
    idle backend's counters within PGSTAT_IDLE_INTERVAL (10 s): the window starts after a
    settling pause of that length, so work done before it is not counted in it. Its end is
    read at once; what the last seconds of the window did may be published later, so the
    window undercounts by at most 10 s of traffic (the same for the baseline)."""
    time.sleep(STATS_SETTLE_SECS)
    before = transactions(admin_url, name)
    started = time.monotonic()
    time.sleep(seconds)
    after = transactions(admin_url, name)
    return after - before, time.monotonic() - started


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def http(method: str, url: str, body: bytes | None = None, ctype: str = "text/plain") -> int:
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", ctype)
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(response.status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--hold", type=float, default=60.0, help="idle hold, seconds")
    parser.add_argument("--baseline", type=float, default=60.0, help="baseline window, seconds")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument(
        "--statements",
        action="store_true",
        help="log the test database's statements (local cluster only) and name those of each "
        "window: what the baseline's transactions are",
    )
    args = parser.parse_args()

    admin_url, db_url, db_name = database_urls()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
        if args.statements:
            conn.execute(f"ALTER DATABASE \"{db_name}\" SET log_statement = 'all'")
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "DJANGO_DEBUG": "false",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(32),
        "DS_SERVER__SSE_RECONNECT_INTERVAL_SECS": "0",
        # Open access, as bench/compare.py runs it: production's default (keys) answers 401.
        "DS_AUTH__MODE": "open",
        # One client stands for all the readers: no limit per client (streams.live_readers).
        "DS_LIVE__MAX_PER_CLIENT": "0",
        "DS_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    server: subprocess.Popen[bytes] | None = None
    clients: list[tuple[mp.Process, Connection]] = []
    log_path = Path(f"/tmp/sse_idle_load_{os.getpid()}.log")
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"],
            cwd=ROOT, env=env, check=True, timeout=300,
        )  # fmt: skip
        nofile = _raise_fd_limit()
        port = free_port()
        command = [
            "prlimit", f"--nofile={nofile}:{nofile}", "--",
            sys.executable, "-m", "uvicorn", "durable_project.asgi:application",
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--backlog", "4096",
            "--loop", "uvloop", "--http", "durable_project.protocol:HttpToolsProtocol",
            "--no-access-log",
            "--timeout-graceful-shutdown", "5",
        ]  # fmt: skip
        print("server:", " ".join(command))
        with log_path.open("wb") as log:
            server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if http("GET", f"{base}/healthz") == 200:
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(log_path.read_text()[-3000:]) from None
                time.sleep(0.2)
        paths = [f"load/sse-{i}" for i in range(args.streams)]
        for path in paths:
            assert http("PUT", f"{base}/v1/stream/{path}", b"") == 201
            assert http("POST", f"{base}/v1/stream/{path}", b"warm-up") == 204
        pid = server.pid  # prlimit execs the server: same process
        time.sleep(2)
        rss_before = rss_mib(pid)
        print(f"server pid {pid}, RSS {rss_before:.1f} MiB, fd limit {nofile}")

        print(f"baseline: {args.baseline:.0f} s with no reader connected...")
        log_mark = _log_size()
        baseline_tx, baseline_secs = count_window(admin_url, db_name, args.baseline)
        baseline_statements = _statements(log_mark) if args.statements else {}

        print(f"opening {args.connections} SSE readers from {args.clients} processes...")
        opened = time.monotonic()
        per_client = [args.connections // args.clients] * args.clients
        per_client[0] += args.connections - sum(per_client)
        first = 0
        for count in per_client:
            parent, child = mp.Pipe()
            process = mp.Process(target=client_process, args=(port, paths, count, first, child))
            process.start()
            clients.append((process, parent))
            first += count
        established = 0
        for _, pipe in clients:
            if not pipe.poll(600):
                raise RuntimeError("a client process did not finish connecting in 600 s")
            established += pipe.recv()["established"]
        open_secs = time.monotonic() - opened
        rss_open = rss_mib(pid)
        print(f"established {established} in {open_secs:.1f} s; server RSS {rss_open:.1f} MiB")

        print(f"holding them idle for {args.hold:.0f} s...")
        log_mark = _log_size()
        idle_tx, idle_secs = count_window(admin_url, db_name, args.hold)
        idle_statements = _statements(log_mark) if args.statements else {}
        still_open = sum(_status(pipe)["open"] for _, pipe in clients)
        rss_after = rss_mib(pid)
        connections_now = len(psutil.Process(pid).net_connections(kind="tcp"))

        print("appending one message to every stream...")
        for path in paths:
            assert http("POST", f"{base}/v1/stream/{path}", b"hello readers") == 204
        delivered_at = time.monotonic()
        got = 0
        while time.monotonic() - delivered_at < DELIVERY_TIMEOUT:
            statuses = [_status(pipe) for _, pipe in clients]
            got = sum(s["got_data"] for s in statuses)
            if got >= still_open:
                break
            time.sleep(1)
        delivery_secs = time.monotonic() - delivered_at
        failures = [f for s in statuses for f in s["failure_sample"]]

        baseline_rate = baseline_tx / baseline_secs
        idle_rate = idle_tx / idle_secs
        report = {
            "connections_requested": args.connections,
            "streams": args.streams,
            "established": established,
            "open_after_hold": still_open,
            "server_tcp_connections_after_hold": connections_now,
            "hold_seconds": round(idle_secs, 1),
            "server_rss_mib_before": round(rss_before, 1),
            "server_rss_mib_with_readers": round(rss_open, 1),
            "server_rss_mib_after_hold": round(rss_after, 1),
            "rss_mib_per_1000_connections": round(
                (rss_after - rss_before) / max(still_open, 1) * 1000, 2
            ),
            "db_transactions_per_s_baseline": round(baseline_rate, 3),
            "db_transactions_per_s_with_idle_readers": round(idle_rate, 3),
            "db_transactions_per_s_due_to_idle_readers": round(idle_rate - baseline_rate, 3),
            "received_the_append": got,
            "delivery_seconds": round(delivery_secs, 1),
            "failures_sample": failures[:5],
        }
        if args.statements:
            report["statements_in_baseline_window"] = baseline_statements
            report["statements_in_idle_window"] = idle_statements
        print(json.dumps(report, indent=2))
        ok = established == args.connections == still_open == got
        print("OK" if ok else "FAILED: not every reader stayed open and got the message")
        return 0 if ok else 1
    finally:
        for process, pipe in clients:
            with contextlib.suppress(Exception):
                pipe.send("stop")
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        with contextlib.suppress(Exception), psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


def _log_file() -> Path:
    from durable_project import localdb

    return localdb.LOG_FILE


def _log_size() -> int:
    with contextlib.suppress(OSError):
        return _log_file().stat().st_size
    return 0


def _statements(since: int) -> dict[str, int]:
    """Statements the cluster logged after byte ``since`` of its log, by text (first 80
    characters), with the settling pause before the window left out (it is logged too)."""
    counts: dict[str, int] = {}
    with _log_file().open("rb") as log:
        log.seek(since)
        lines = log.read().decode("utf-8", "replace").splitlines()
    for line in lines:
        for marker in ("statement: ", "execute <unnamed>: ", "execute "):
            if f"LOG:  {marker}" in line:
                text = line.split(f"LOG:  {marker}", 1)[1].strip()[:80]
                counts[text] = counts.get(text, 0) + 1
                break
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def _status(pipe: Connection) -> dict[str, Any]:
    pipe.send("status")
    if not pipe.poll(60):
        raise RuntimeError("a client process stopped answering")
    return pipe.recv()


if __name__ == "__main__":
    sys.exit(main())
