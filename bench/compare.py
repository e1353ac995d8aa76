"""Side-by-side benchmark of this server against the Node reference server.

Usage: python bench/compare.py [--only NAME,...] [--runs N] [--quick]
                               [--ours-url URL] [--node-url URL] [--json PATH]

Starts both servers unless given their URLs: this one with the README's production command
(uvicorn, 2 workers, uvloop, httptools) on a freshly created and migrated database in the
local PostgreSQL cluster (or on the server of DATABASE_URL), dropped at the end; the Node
reference server (@durable-streams/server, pinned in bench/js) with its durable file store in
a scratch directory, removed at the end. Both listen on 127.0.0.1 in 18700-18799.

Every workload runs on both servers with the same client (aiohttp on one event loop; the
upstream shapes through the official TypeScript client in bench/js), the order of the two
servers alternating from one workload and run to the next so that the machine's noise hits
both alike. After every workload that writes, every stream written is read back from -1 and
every acknowledged append must be there exactly once, in the order each writer was
acknowledged: anything else fails the run.

Prints one table: each figure (median over --runs), ours/node, which way is better, the goal
(a bound on ours/node) and whether it is met; then the CPU seconds client, server and
PostgreSQL spent in each workload's timed part, to show where the time went.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import functools
import json
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from common import percentile, producer_headers

ROOT = Path(__file__).resolve().parent.parent
JS_DIR = ROOT / "bench" / "js"
PORTS = range(18700, 18800)
LONG_POLL_TIMEOUT_SECS = 30  # both servers' default, set explicitly on both
SECRET_KEY = "bench-compare-not-a-secret"  # a throwaway server's key

sys.path.insert(0, str(ROOT))


class VerificationError(AssertionError):
    """A stream read back does not hold exactly what its writers were acknowledged for."""


# --------------------------------------------------------------------------------------------
# Processes: the tree under a pid, its memory and CPU time (from /proc)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def tree_rss(root: int) -> int:
    """Resident memory of a process and all its descendants, in bytes."""
    total = 0
    for pid in _process_tree(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def tree_cpu(root: int) -> float:
    """CPU seconds of a process and its descendants, living and reaped."""
    ticks = 0
    for pid in _process_tree(root):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return ticks / CLOCK_TICKS


def machine_load() -> str:
    """The 1-minute load average, and the share of the last minute in which some runnable task
    waited for a CPU (Linux pressure stall information): how busy the machine was."""
    text = f"load {os.getloadavg()[0]:.1f}"
    with contextlib.suppress(OSError, IndexError, ValueError):
        some = Path("/proc/pressure/cpu").read_text().split()[2]  # "avg60=12.34"
        text += f", CPU pressure {float(some.split('=')[1]):.0f}%"
    return text


def client_cpu() -> float:
    """CPU seconds of this process and its reaped children (the Node client, subscribers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def free_port(taken: set[int]) -> int:
    for port in PORTS:
        if port in taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


def wait_http_ready(url: str, process: subprocess.Popen[bytes], log: Path, ok: set[int]) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                status = response.status
        except urllib.error.HTTPError as error:
            status = error.code
        except OSError:
            status = None
        if status in ok:
            return
        time.sleep(0.1)
    raise RuntimeError(f"server at {url} did not come up:\n{log.read_text()[-3000:]}")


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --------------------------------------------------------------------------------------------
# The two servers


@dataclass
class Target:
    """A server under test: its base URL and, when this script started it, its root pid (for
    memory and CPU) and the PostgreSQL postmaster's (for ours on the local cluster)."""

    name: str
    base_url: str
    pid: int | None = None
    db_pid: int | None = None
    collects_garbage: bool = False  # SIGUSR2 runs a full GC (the Node server, --expose-gc)

    def stream(self, path: str) -> str:
        return f"{self.base_url}/v1/stream/{path}"

    def rss(self) -> int | None:
        return tree_rss(self.pid) if self.pid else None

    def cpu(self) -> float | None:
        return tree_cpu(self.pid) if self.pid else None

    def db_cpu(self) -> float | None:
        return tree_cpu(self.db_pid) if self.db_pid else None

    async def collect_garbage(self) -> None:
        if self.collects_garbage and self.pid:
            os.kill(self.pid, signal.SIGUSR2)
            await asyncio.sleep(0.5)


# With --auth keys, the Authorization header every client sends (the aiohttp sessions, the
# fan-out subscribers, the TypeScript client script read it from the environment).
AUTHORIZATION_ENV = "DS_BENCH_AUTHORIZATION"


def client_headers() -> dict[str, str]:
    headers = {"Accept-Encoding": "identity"}
    if os.environ.get(AUTHORIZATION_ENV):
        headers["Authorization"] = os.environ[AUTHORIZATION_ENV]
    return headers


class OursServer:
    """This server: uvicorn as the README's production command, on a fresh database."""

    def __init__(
        self,
        port: int,
        logs: Path,
        auth: str,
        *,
        name: str = "ours",
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        self.auth = auth
        self.name = name
        self.overrides = env or {}
        self.log_path = logs / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.admin_url = ""
        self.database = f"bench_compare_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.database_url = ""
        self.db_pid: int | None = None

    def _admin(self) -> Any:
        import psycopg

        return psycopg.connect(self.admin_url, autocommit=True)

    def start(self) -> Target:
        configured = os.environ.get("DATABASE_URL", "")
        socket_dir = ""
        if configured:
            self.admin_url = configured
        else:
            from durable_project import localdb

            self.admin_url = localdb.ensure_running()
            # As `make serve` does with the local cluster: the server's own connections go
            # through its Unix socket (settings: DS_DB__SOCKET_DIR).
            socket_dir = localdb.socket_directory() or ""
            pid_file = localdb.CLUSTER_DIR / "postmaster.pid"
            with contextlib.suppress(OSError, ValueError):
                self.db_pid = int(pid_file.read_text().split()[0])
        parts = urlsplit(self.admin_url)
        self.database_url = urlunsplit(parts._replace(path=f"/{self.database}"))
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')
        env = {
            **os.environ,
            "DATABASE_URL": self.database_url,
            "DJANGO_DEBUG": "false",
            "DJANGO_SECRET_KEY": SECRET_KEY,
            "DS_SERVER__LONG_POLL_TIMEOUT_SECS": str(LONG_POLL_TIMEOUT_SECS),
            "DS_AUTH__MODE": self.auth,
            "DS_DB__SOCKET_DIR": socket_dir,
            "PYTHONUNBUFFERED": "1",
            **self.overrides,
        }
        env.pop("DJANGO_SETTINGS_MODULE", None)
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"],
            cwd=ROOT, env=env, check=True,
        )  # fmt: skip
        if env["DS_AUTH__MODE"] == "keys":
            # Every client of the run sends this key (AUTHORIZATION_ENV); Node ignores it.
            made = subprocess.run(
                [sys.executable, "manage.py", "create_api_key", "bench", "--grant",
                 ":read,append,manage"],
                cwd=ROOT, env=env, check=True, capture_output=True, text=True,
            )  # fmt: skip
            key = made.stdout.strip().splitlines()[-1]
            os.environ[AUTHORIZATION_ENV] = f"Bearer {key}"
        with contextlib.suppress(Exception), self._connect_db() as conn:
            conn.execute("CHECKPOINT")  # start from a clean WAL state, as docs/benchmarks.md
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "uvicorn", "durable_project.asgi:application",
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "2",
                "--loop", "uvloop", "--http", "durable_project.protocol:HttpToolsProtocol",
                "--no-access-log",
            ],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        base = f"http://127.0.0.1:{self.port}"
        wait_http_ready(f"{base}/healthz", self.process, self.log_path, {200})
        return Target(self.name, base, self.process.pid, self.db_pid)

    def _connect_db(self) -> Any:
        import psycopg

        return psycopg.connect(self.database_url, autocommit=True)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self._log.close()
        if self.database_url:
            with self._admin() as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')


class NodeServer:
    """The Node reference server with its durable file store in a scratch directory."""

    def __init__(self, port: int, logs: Path, max_file_handles: int) -> None:
        self.port = port
        self.max_file_handles = max_file_handles
        self.log_path = logs / "node.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.data_dir: Path | None = None

    def start(self) -> Target:
        node = shutil.which("node")
        if node is None:
            raise RuntimeError("node is not on PATH (make bench-compare installs it)")
        if not (JS_DIR / "node_modules" / "@durable-streams" / "server").is_dir():
            raise RuntimeError(f"run 'npm ci' in {JS_DIR} (make bench-compare does)")
        self.data_dir = Path(tempfile.mkdtemp(prefix="ds-node-store-"))
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                node, "--expose-gc", "node-server.mjs", "--port", str(self.port),
                "--data-dir", str(self.data_dir / "store"),
                "--long-poll-timeout-ms", str(LONG_POLL_TIMEOUT_SECS * 1000),
                *(["--max-file-handles", str(self.max_file_handles)]
                  if self.max_file_handles else []),
            ],
            cwd=JS_DIR, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        base = f"http://127.0.0.1:{self.port}"
        wait_http_ready(f"{base}/v1/stream/__ready_probe__", self.process, self.log_path, {404})
        return Target("node", base, self.process.pid, collects_garbage=True)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self._log.close()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)


class NullServer:
    """With --ceiling: bench/js/null-server.mjs, which answers what the latency workloads ask
    from memory and does nothing else. What a workload measures on it is as good as the client
    and the machine allow any server to do: a goal beyond it cannot be met by any server."""

    def __init__(self, port: int, logs: Path) -> None:
        self.port = port
        self.log_path = logs / "ceiling.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Target:
        node = shutil.which("node")
        if node is None:
            raise RuntimeError("node is not on PATH (make bench-compare installs it)")
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [node, "null-server.mjs", "--port", str(self.port)],
            cwd=JS_DIR, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        base = f"http://127.0.0.1:{self.port}"
        wait_http_ready(f"{base}/v1/stream/__ready_probe__", self.process, self.log_path, {404})
        return Target("ceiling", base, self.process.pid)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self._log.close()


# --------------------------------------------------------------------------------------------
# Records every write carries, so reads can be checked: "<tag>#<seq>|" padded with "." to a
# fixed size (binary and text streams), or {"w": tag, "seq": n, ...} (JSON streams).


# With --incompressible (DS_BENCH_INCOMPRESSIBLE=1), records are padded with random letters
# instead of dots: what a compressing store cannot shrink (lz4 finds no repeats in them).
INCOMPRESSIBLE_ENV = "DS_BENCH_INCOMPRESSIBLE"
_LETTERS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
NOISE_BYTES = 2 * 1024 * 1024


@functools.cache
def _noise() -> bytes:
    """Letters from a multiplicative hash of their index: the same noise as
    bench/js/upstream-shapes.mjs makes, so records written by either are checked alike."""
    return bytes(_LETTERS[(((i * 2654435761) & 0xFFFFFFFF) >> 11) % 62] for i in range(NOISE_BYTES))


def record(tag: str, seq: int, size: int) -> bytes:
    head = f"{tag}#{seq:07d}|".encode()
    if os.environ.get(INCOMPRESSIBLE_ENV) == "1":
        start = (seq * 7919) % (NOISE_BYTES - size)
        return head + _noise()[start + len(head) : start + size]
    return head + b"." * (size - len(head))


def check_records(
    what: str,
    data: bytes,
    size: int,
    expected: dict[str, list[int]],
    ordered: bool = True,
) -> None:
    """``data`` must be exactly the records ``expected`` lists (tag -> acknowledged seqs): each
    once, and per tag in that order when ``ordered`` (one writer's acknowledged appends)."""
    if len(data) % size:
        raise VerificationError(f"{what}: {len(data)} bytes is not a whole number of records")
    got: dict[str, list[int]] = defaultdict(list)
    for start in range(0, len(data), size):
        chunk = data[start : start + size]
        head = chunk[: chunk.find(b"|") + 1]
        tag, _, seq = head[:-1].decode(errors="replace").partition("#")
        if not head or not seq.isdigit() or chunk != record(tag, int(seq), size):
            raise VerificationError(f"{what}: corrupt record at byte {start}: {chunk[:40]!r}")
        got[tag].append(int(seq))
    compare_sequences(what, got, expected, ordered)


def compare_sequences(
    what: str, got: dict[str, list[int]], expected: dict[str, list[int]], ordered: bool
) -> None:
    for tag in sorted(set(got) | set(expected)):
        have, want = got.get(tag, []), expected.get(tag, [])
        if have == want or (not ordered and sorted(have) == sorted(want)):
            continue
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        dups = sorted({s for s in have if have.count(s) > 1}) if len(have) < 20000 else "?"
        raise VerificationError(
            f"{what}: writer {tag!r}: stored {len(have)} of {len(want)} acknowledged appends; "
            f"missing {missing[:10]}, not acknowledged {extra[:10]}, duplicated {dups}, "
            f"{'out of order' if sorted(have) == sorted(want) else ''}"
        )


# --------------------------------------------------------------------------------------------
# The client and what the workloads share


@dataclass
class Timed:
    """CPU and wall seconds spent in a workload's timed parts."""

    wall: float = 0.0
    client: float = 0.0
    server: float | None = None
    db: float | None = None
    note: str = ""


@dataclass
class Context:
    session: aiohttp.ClientSession
    target: Target
    quick: bool
    prefix: str
    fanout_subscribers: int = 1000
    timed_parts: Timed = field(default_factory=Timed)

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def path(self, name: str) -> str:
        return self.target.stream(f"{self.prefix}/{name}")

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Around the part of a workload its figure comes from: adds up where the CPU went."""
        server, db = self.target.cpu(), self.target.db_cpu()
        client, wall = client_cpu(), time.perf_counter()
        yield
        t = self.timed_parts
        t.wall += time.perf_counter() - wall
        t.client += client_cpu() - client
        if server is not None:
            t.server = (t.server or 0.0) + (self.target.cpu() or 0.0) - server
        if db is not None:
            t.db = (t.db or 0.0) + (self.target.db_cpu() or 0.0) - db

    async def create(self, url: str, content_type: str = "application/octet-stream") -> str:
        """PUT; returns the tail offset."""
        async with self.session.put(url, headers={"Content-Type": content_type}) as response:
            if response.status not in (200, 201):
                raise RuntimeError(f"create {url} answered {response.status}")
            return response.headers.get("Stream-Next-Offset", "-1")

    async def append(self, url: str, body: bytes, headers: dict[str, str]) -> str:
        async with self.session.post(url, data=body, headers=headers) as response:
            if response.status not in (200, 204):
                text = await response.text()
                raise RuntimeError(f"append to {url} answered {response.status}: {text[:200]}")
            return response.headers["Stream-Next-Offset"]

    async def read_all(self, url: str) -> list[bytes]:
        """Catch-up read from -1, following Stream-Next-Offset until Stream-Up-To-Date."""
        offset, parts = "-1", []
        while True:
            async with self.session.get(url, params={"offset": offset}) as response:
                if response.status != 200:
                    raise RuntimeError(f"read {url} answered {response.status}")
                parts.append(await response.read())
                offset = response.headers["Stream-Next-Offset"]
                if response.headers.get("Stream-Up-To-Date") == "true":
                    return parts

    async def verify(
        self, url: str, size: int, expected: dict[str, list[int]], ordered: bool = True
    ) -> None:
        check_records(url, b"".join(await self.read_all(url)), size, expected, ordered)

    async def delete(self, url: str) -> None:
        async with self.session.delete(url) as response:
            if response.status not in (200, 204):
                raise RuntimeError(f"delete {url} answered {response.status}")


BINARY = {"Content-Type": "application/octet-stream"}
Figures = dict[str, float | None]


async def gather_limited(limit: int, coroutines: list[Awaitable[Any]]) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(coroutine: Awaitable[Any]) -> Any:
        async with gate:
            return await coroutine

    return await asyncio.gather(*(one(c) for c in coroutines))


# --------------------------------------------------------------------------------------------
# Workloads. Each runs on one server through a Context: prepare() (streams, data, warm-up; not
# timed), then measure() in slices, then finish() (read back, check, figures). The runner
# interleaves the two servers' slices (ours, node, node, ours, ...), so that a burst of noise
# from whatever else runs on the machine falls on both rather than on one.


def share(total: int, part: int, parts: int) -> range:
    """Part ``part`` of ``parts`` of ``range(total)``."""
    return range(total * part // parts, total * (part + 1) // parts)


class Workload:
    slices = 4

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def prepare(self) -> None:
        pass

    async def measure(self, part: int, parts: int) -> None:
        raise NotImplementedError

    async def finish(self) -> Figures:
        raise NotImplementedError


class Writers(Workload):
    """Writers with one append in flight each, on streams of their own or on one shared stream
    (idempotent producers there); figure: records or bytes per second."""

    key = ""
    writers = 16
    per_writer = (500, 30)  # full, quick
    size = 100
    shared = False
    idempotent = False
    warmup = 5

    async def prepare(self) -> None:
        ctx = self.ctx
        self.count = ctx.n(*self.per_writer)
        self.urls = (
            [ctx.path("shared")] * self.writers
            if self.shared
            else [ctx.path(f"w{i}") for i in range(self.writers)]
        )
        for url in dict.fromkeys(self.urls):
            await ctx.create(url)
        self.acked: dict[str, list[int]] = {f"w{i}": [] for i in range(self.writers)}
        self.seconds = 0.0
        await asyncio.gather(*(self.writer(i, range(self.warmup)) for i in range(self.writers)))

    async def writer(self, index: int, seqs: range) -> None:
        tag = f"w{index}"
        for seq in seqs:
            headers = (
                producer_headers("application/octet-stream", tag, seq)
                if self.idempotent
                else BINARY
            )
            await self.ctx.append(self.urls[index], record(tag, seq, self.size), headers)
            self.acked[tag].append(seq)

    async def measure(self, part: int, parts: int) -> None:
        seqs = share(self.count, part, parts)
        seqs = range(self.warmup + seqs.start, self.warmup + seqs.stop)
        with self.ctx.timed():
            start = time.perf_counter()
            await asyncio.gather(*(self.writer(i, seqs) for i in range(self.writers)))
            self.seconds += time.perf_counter() - start

    async def finish(self) -> Figures:
        for index, url in enumerate(self.urls):
            tag = f"w{index}"
            if not self.shared:
                await self.ctx.verify(url, self.size, {tag: self.acked[tag]})
        if self.shared:
            await self.ctx.verify(self.urls[0], self.size, self.acked)
        records = self.writers * self.count
        return {self.key: self.figure(records, self.seconds)}

    def figure(self, records: int, seconds: float) -> float:
        return records / seconds


class OwnStreams(Writers):
    key = "own_streams"


class Idempotent(Writers):
    key = "idempotent"
    shared = True
    idempotent = True


class Append64K(Writers):
    key = "append_64k"
    writers, per_writer, size, warmup = 8, (160, 8), 64 * 1024, 2

    def figure(self, records: int, seconds: float) -> float:
        return records * self.size / seconds / 1e6


class Append1M(Writers):
    key = "append_1m"
    writers, per_writer, size, warmup = 4, (40, 4), 1024 * 1024, 1

    def figure(self, records: int, seconds: float) -> float:
        return records * self.size / seconds / 1e6


class CatchUp(Workload):
    """Catch-up reads from -1 of a stream written once; figure: MB/s of one read (median)."""

    async def timed_read(self, reads: int) -> None:
        for _ in range(reads):
            with self.ctx.timed():
                start = time.perf_counter()
                self.parts = await self.ctx.read_all(self.url)
                self.times.append(time.perf_counter() - start)

    async def measure(self, part: int, parts: int) -> None:
        await self.timed_read(len(share(self.reads, part, parts)))


class CatchUpJson(CatchUp):
    async def prepare(self) -> None:
        ctx = self.ctx
        self.url = ctx.path("catchup-json")
        await ctx.create(self.url, "application/json")
        self.count, batch, self.reads = ctx.n(20_000, 2_000), 500, ctx.n(12, 4)
        self.pad = "z" * 170
        encoded = [
            json.dumps({"w": "j", "seq": i, "pad": self.pad}, separators=(",", ":"))
            for i in range(self.count)
        ]
        # MB/s of the messages' own JSON (as appended), not of the response bytes: the two
        # servers may lay the array out differently.
        self.payload = sum(len(e) for e in encoded)
        headers = {"Content-Type": "application/json"}
        for first in range(0, self.count, batch):
            body = "[" + ",".join(encoded[first : first + batch]) + "]"
            await ctx.append(self.url, body.encode(), headers)
        self.times: list[float] = []
        self.parts = await ctx.read_all(self.url)  # warm-up

    async def finish(self) -> Figures:
        items: list[Any] = []
        for part in self.parts:
            items.extend(json.loads(part) if part.strip() else [])
        got: dict[str, list[int]] = defaultdict(list)
        for item in items:
            got[item["w"]].append(item["seq"])
            if item["pad"] != self.pad:
                raise VerificationError(f"{self.url}: message {item['seq']} corrupt")
        compare_sequences(self.url, got, {"j": list(range(self.count))}, ordered=True)
        return {"catchup_json": self.payload / statistics.median(self.times) / 1e6}


class CatchUpBinary(CatchUp):
    async def prepare(self) -> None:
        ctx = self.ctx
        self.url = ctx.path("catchup-bin")
        await ctx.create(self.url)
        self.count, self.size, self.reads = ctx.n(80, 16), 64 * 1024, ctx.n(24, 4)
        for seq in range(self.count):
            await ctx.append(self.url, record("b", seq, self.size), BINARY)
        self.times: list[float] = []
        self.parts = await ctx.read_all(self.url)  # warm-up

    async def finish(self) -> Figures:
        check_records(self.url, b"".join(self.parts), self.size, {"b": list(range(self.count))})
        return {"catchup_binary": self.count * self.size / statistics.median(self.times) / 1e6}


class Rtt(Workload):
    """One client, one append at a time; figure: round trip p50."""

    async def prepare(self) -> None:
        self.url = self.ctx.path("rtt")
        await self.ctx.create(self.url)
        self.count, self.samples = self.ctx.n(1000, 48), []
        for seq in range(20):
            await self.ctx.append(self.url, record("r", seq, 100), BINARY)

    async def measure(self, part: int, parts: int) -> None:
        with self.ctx.timed():
            for seq in share(self.count, part, parts):
                start = time.perf_counter()
                await self.ctx.append(self.url, record("r", 20 + seq, 100), BINARY)
                self.samples.append((time.perf_counter() - start) * 1000)

    async def finish(self) -> Figures:
        await self.ctx.verify(self.url, 100, {"r": list(range(20 + self.count))})
        return {"rtt": percentile(self.samples, 0.5)}


TEXT = {"Content-Type": "text/plain"}


class Sse(Workload):
    """One SSE subscriber; append, wait for the event, repeat; figure: append sent -> event
    received, p50."""

    size, warmup = 10, 10

    async def prepare(self) -> None:
        ctx = self.ctx
        self.url = ctx.path("sse")
        tail = await ctx.create(self.url, "text/plain")
        self.count, self.samples, self.next = ctx.n(500, 48), [], 0
        self.arrived: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
        self.reader = asyncio.create_task(self.read(tail))
        await asyncio.sleep(0.3)
        await self.round_trips(self.warmup, keep=False)

    async def read(self, tail: str) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        params = {"offset": tail, "live": "sse"}
        async with self.ctx.session.get(self.url, params=params, timeout=timeout) as response:
            rest = b""
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                data = rest + chunk
                cut = data.rfind(b"\n") + 1
                rest = data[cut:]
                for line in data[:cut].split(b"\n"):
                    if line.startswith(b"data:") and b"#" in line:
                        self.arrived.put_nowait((int(line.split(b"#", 1)[1][:7]), now))

    async def round_trips(self, count: int, keep: bool) -> None:
        for _ in range(count):
            seq, self.next = self.next, self.next + 1
            start = time.perf_counter()
            await self.ctx.append(self.url, record("s", seq, self.size), TEXT)
            got, received = await asyncio.wait_for(self.arrived.get(), 10)
            if got != seq:
                raise VerificationError(f"{self.url}: SSE delivered {got}, expected {seq}")
            if keep:
                self.samples.append((received - start) * 1000)

    async def measure(self, part: int, parts: int) -> None:
        with self.ctx.timed():
            await self.round_trips(len(share(self.count, part, parts)), keep=True)

    async def finish(self) -> Figures:
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader
        await self.ctx.verify(self.url, self.size, {"s": list(range(self.next))})
        return {"sse": percentile(self.samples, 0.5)}


class LongPoll(Workload):
    """A long-poll waiting at the tail, then an append; figure: append sent -> poll answered,
    p50."""

    size, warmup = 10, 5

    async def prepare(self) -> None:
        self.url = self.ctx.path("long-poll")
        self.offset = await self.ctx.create(self.url, "text/plain")
        self.count, self.samples, self.next = self.ctx.n(500, 48), [], 0
        await self.round_trips(self.warmup, keep=False)

    async def poll(self, offset: str) -> tuple[int, bytes, str]:
        params = {"offset": offset, "live": "long-poll"}
        async with self.ctx.session.get(self.url, params=params) as response:
            return response.status, await response.read(), response.headers["Stream-Next-Offset"]

    async def round_trips(self, count: int, keep: bool) -> None:
        for _ in range(count):
            seq, self.next = self.next, self.next + 1
            task = asyncio.create_task(self.poll(self.offset))
            await asyncio.sleep(0.002)  # let the poll reach the server and wait
            start = time.perf_counter()
            await self.ctx.append(self.url, record("l", seq, self.size), TEXT)
            status, body, self.offset = await task
            if keep:
                self.samples.append((time.perf_counter() - start) * 1000)
            if status != 200 or body != record("l", seq, self.size):
                raise VerificationError(f"{self.url}: long-poll answered {status} {body[:40]!r}")

    async def measure(self, part: int, parts: int) -> None:
        with self.ctx.timed():
            await self.round_trips(len(share(self.count, part, parts)), keep=True)

    async def finish(self) -> Figures:
        await self.ctx.verify(self.url, self.size, {"l": list(range(self.next))})
        return {"long_poll": percentile(self.samples, 0.5)}


FANOUT_DRAIN_SECS = 10.0  # after the last append, how long late deliveries may still arrive


class Fanout(Workload):
    """SSE subscribers (1,000) on one stream, one writer at 100 appends/s for 10 s (one append
    in flight: a server slower than 10 ms an append gets fewer). A delivery that has not arrived
    FANOUT_DRAIN_SECS after the last append counts as infinitely late (and in the "delivered"
    row); the stream itself must still hold every append. Not sliced: one 10-s episode.

    Memory: the server's RSS (all its processes) before the subscribers connect, while the
    writer runs (median of samples every 0.5 s), and per subscriber: (connected and idle -
    before) / subscribers, both medians of 5 samples taken after a full garbage collection on
    the Node server."""

    slices = 1
    size = 12

    async def measure(self, part: int, parts: int) -> None:
        ctx = self.ctx
        self.url = url = ctx.path("fanout")
        tail = await ctx.create(url, "text/plain")
        self.subscribers = subscribers = 100 if ctx.quick else ctx.fanout_subscribers
        rate, seconds = (100, 3) if ctx.quick else (100, 10)
        self.messages = messages = rate * seconds
        await ctx.target.collect_garbage()
        self.rss_before = await self.rss_median(5)
        with tempfile.TemporaryDirectory(prefix="ds-fanout-") as scratch:
            out = Path(scratch) / "arrivals"
            child = await asyncio.create_subprocess_exec(
                sys.executable, str(Path(__file__).parent / "fanout_client.py"), url, tail,
                str(subscribers), str(messages), str(out), str(1 + seconds + FANOUT_DRAIN_SECS),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert child.stdin is not None and child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), 120)
            if line.strip() != b"ready":
                await child.wait()
                raise RuntimeError(f"fan-out subscribers did not connect: {line!r}")
            await asyncio.sleep(0.5)
            await ctx.target.collect_garbage()
            self.rss_connected = await self.rss_median(5)
            self.sent = sent = array.array("d", bytes(8 * messages))
            self.rss_during: list[int] = []

            async def sample_memory() -> None:
                while True:
                    await asyncio.sleep(0.5)
                    self.rss_during.append(ctx.target.rss() or 0)

            sampler = asyncio.create_task(sample_memory()) if self.rss_before else None
            with ctx.timed():
                self.start = start = time.monotonic()
                self.written = 0
                while self.written < messages and time.monotonic() < start + seconds:
                    await asyncio.sleep(max(0.0, start + self.written / rate - time.monotonic()))
                    sent[self.written] = time.monotonic()
                    await ctx.append(url, record("f", self.written, self.size), TEXT)
                    self.written += 1
                self.write_seconds = time.monotonic() - start
                child.stdin.write(f"{self.written}\n".encode())
                await child.stdin.drain()
                child.stdin.close()
                output = (await child.stdout.read()).decode().strip().splitlines()
                await child.wait()
            if sampler is not None:
                sampler.cancel()
            if child.returncode != 0 or not output:
                raise RuntimeError(f"fan-out subscribers exited {child.returncode}: {output}")
            self.summary = json.loads(output[-1])
            self.arrivals = array.array("d")
            with out.open("rb") as f:
                self.arrivals.fromfile(f, subscribers * messages)

    async def rss_median(self, samples: int) -> int | None:
        """The server's RSS, median of a few samples 0.2 s apart: a garbage-collected heap
        (Node's) moves by megabytes between samples."""
        found = []
        for _ in range(samples):
            rss = self.ctx.target.rss()
            if rss is None:
                return None
            found.append(rss)
            await asyncio.sleep(0.2)
        return int(statistics.median(found))

    async def finish(self) -> Figures:
        written, messages, subscribers = self.written, self.messages, self.subscribers
        await self.ctx.verify(self.url, self.size, {"f": list(range(written))})
        arrivals, sent = self.arrivals, self.sent
        latencies = [
            (arrivals[i * messages + s] - sent[s]) * 1000
            if arrivals[i * messages + s]
            else math.inf
            for i in range(subscribers)
            for s in range(written)
        ]
        latencies.sort()
        delivered = sum(1 for v in latencies if v != math.inf)
        last = max(arrivals) if delivered else self.start
        self.ctx.timed_parts.note = (
            f"{subscribers} subscribers; {written} appends, {written / self.write_seconds:.0f}/s;"
            f" {delivered:,} of {len(latencies):,} deliveries; subscriber process "
            f"{self.summary['cpu_s']:.1f} CPU s in {self.summary['wall_s']:.1f} s"
        )
        figures: Figures = {
            "fanout_p50": percentile(latencies, 0.5),
            "fanout_p99": percentile(latencies, 0.99),
            "fanout_delivered": 100 * delivered / len(latencies),
            "fanout_rate": delivered / (last - self.start),
            "fanout_rss_before": None,
            "fanout_rss_during": None,
            "fanout_rss_per_sub": None,
        }
        if self.rss_before and self.rss_connected and self.rss_during:
            figures["fanout_rss_before"] = self.rss_before / 2**20
            figures["fanout_rss_during"] = statistics.median(self.rss_during) / 2**20
            figures["fanout_rss_per_sub"] = (
                (self.rss_connected - self.rss_before) / subscribers / 1024
            )
        return figures


class Creates(Workload):
    """300 concurrent PUTs, each on a fresh connection (as 300 clients would); one round per
    slice, figure: the median wall time."""

    slices = 3

    async def prepare(self) -> None:
        self.count, self.times = self.ctx.n(300, 60), []
        self.urls: list[str] = []

    async def measure(self, part: int, parts: int) -> None:
        urls = [self.ctx.path(f"{part}/{i}") for i in range(self.count)]
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, headers=client_headers()) as session:

            async def put(url: str) -> int:
                async with session.put(url, headers=BINARY) as response:
                    return response.status

            with self.ctx.timed():
                start = time.perf_counter()
                statuses = await asyncio.gather(*(put(u) for u in urls))
                self.times.append(time.perf_counter() - start)
        if any(s != 201 for s in statuses):
            raise VerificationError(f"creates: statuses {sorted(set(statuses))}, expected 201")
        self.urls.extend(urls)

    async def finish(self) -> Figures:
        heads = await gather_limited(32, [self.ctx.session.head(u) for u in self.urls])
        if any(h.status != 200 for h in heads):
            raise VerificationError("creates: a created stream is missing")
        for h in heads:
            h.release()
        for url in self.urls[:: max(1, self.count // 30)]:
            await self.ctx.verify(url, 100, {})  # empty
        return {"creates": statistics.median(self.times) * 1000}


class ManyStreams(Workload):
    """64 writers over 1,000 streams (each stream has one writer, who cycles through its
    streams), one append in flight each; figure: appends/s."""

    writers = 64

    async def prepare(self) -> None:
        ctx = self.ctx
        streams = 200 if ctx.quick else 1000
        self.count = ctx.n(150, 12)
        self.urls = [ctx.path(f"{i}") for i in range(streams)]
        await gather_limited(64, [ctx.create(u) for u in self.urls])
        self.acked: dict[int, list[int]] = defaultdict(list)  # stream -> its writer's seqs
        self.seconds = 0.0
        await asyncio.gather(*(self.writer(i, range(2)) for i in range(self.writers)))

    async def writer(self, index: int, seqs: range) -> None:
        own = range(index, len(self.urls), self.writers)
        for seq in seqs:
            target = own[seq % len(own)]
            await self.ctx.append(self.urls[target], record(f"w{index}", seq, 100), BINARY)
            self.acked[target].append(seq)

    async def measure(self, part: int, parts: int) -> None:
        seqs = share(self.count, part, parts)
        seqs = range(2 + seqs.start, 2 + seqs.stop)
        with self.ctx.timed():
            start = time.perf_counter()
            await asyncio.gather(*(self.writer(i, seqs) for i in range(self.writers)))
            self.seconds += time.perf_counter() - start

    async def finish(self) -> Figures:
        await gather_limited(
            32,
            [
                self.ctx.verify(u, 100, {f"w{i % self.writers}": self.acked[i]})
                for i, u in enumerate(self.urls)
            ],
        )
        return {"many_streams": self.writers * self.count / self.seconds}


# Warm-up iterations of each upstream shape per client process: tinybench's warmupIterations
# (5 in tinybench 2, under vitest 1-3; 16 in the versions under vitest 4).
UPSTREAM_WARMUP_ITERATIONS = 5


class Upstream(Workload):
    """The upstream benchmark package's shapes through the official TypeScript client
    (bench/js/upstream-shapes.mjs), a share of the iterations per slice. Each slice is a new
    client process, which warms each shape up first as upstream's harness does (tinybench's
    warm-up iterations, not measured; their medians are reported apart)."""

    async def prepare(self) -> None:
        self.node = shutil.which("node")
        if self.node is None:
            raise RuntimeError("node is not on PATH")
        self.report: dict[str, list[Any]] = defaultdict(list)

    async def measure(self, part: int, parts: int) -> None:
        ctx = self.ctx
        iterations = {
            "--latency-iterations": ctx.n(20, 4),
            "--small-iterations": ctx.n(8, 4),
            "--large-iterations": ctx.n(4, 4),
        }
        args = [
            str(a) for flag, n in iterations.items() for a in (flag, len(share(n, part, parts)))
        ]
        args += ["--small-count", str(ctx.n(1000, 200)), "--large-count", str(ctx.n(50, 10))]
        args += ["--warmup-iterations", str(ctx.n(UPSTREAM_WARMUP_ITERATIONS, 1))]
        with ctx.timed():
            process = await asyncio.create_subprocess_exec(
                self.node, "upstream-shapes.mjs", "--base-url", ctx.target.base_url,
                "--prefix", f"{ctx.prefix}/{part}", *args,
                cwd=JS_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            stdout, stderr = await asyncio.wait_for(process.communicate(), 600)
        if process.returncode != 0:
            raise RuntimeError(f"upstream-shapes.mjs exited {process.returncode}:\n{stderr!r}")
        for key, values in json.loads(stdout.decode().strip().splitlines()[-1]).items():
            self.report[key].extend(values)

    async def finish(self) -> Figures:
        for stream in self.report["streams"]:
            expected = {stream["tag"]: list(range(stream["count"]))}
            await self.ctx.verify(stream["url"], stream["size"], expected, ordered=False)
            await self.ctx.delete(stream["url"])
        return {
            "up_rtt": statistics.median(self.report["rtt_ms"]),
            "up_cycle": statistics.median(self.report["cycle_ms"]),
            "up_small": statistics.median(self.report["small_msgs_per_s"]),
            "up_large": statistics.median(self.report["large_msgs_per_s"]),
            "up_small_warmup": statistics.median(self.report["warmup_small_msgs_per_s"]),
            "up_large_warmup": statistics.median(self.report["warmup_large_msgs_per_s"]),
        }


# --------------------------------------------------------------------------------------------
# Rows of the table


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    goal: float | None  # bound on ours/node: >= goal when higher is better, else <= goal
    digits: int = 1


ROWS = [
    Row("own_streams", "16 producers, own streams, 100 B", "msg/s", True, 2.0, 0),
    Row("idempotent", "16 idempotent producers, one stream, 100 B", "msg/s", True, 3.0, 0),
    Row("append_64k", "64 KiB appends, 8 writers (own streams)", "MB/s", True, 1.5),
    Row("append_1m", "1 MiB appends, 4 writers (own streams)", "MB/s", True, 1.0),
    Row("catchup_json", "catch-up read, JSON, 20,000 messages", "MB/s", True, 1.0),
    Row("catchup_binary", "catch-up read, binary, 80 x 64 KiB", "MB/s", True, 1.0),
    Row("rtt", "append round trip p50, 1 client", "ms", False, 0.8, 2),
    Row("sse", "SSE delivery p50, 1 subscriber", "ms", False, 0.7, 2),
    Row("long_poll", "long-poll delivery p50", "ms", False, 0.8, 2),
    Row("fanout_p50", "1,000 SSE subscribers: delivery p50", "ms", False, None, 1),
    Row("fanout_p99", "1,000 SSE subscribers: delivery p99", "ms", False, 1.0, 1),
    Row("fanout_delivered", "1,000 SSE subscribers: delivered in time", "%", True, None),
    Row("fanout_rate", "1,000 SSE subscribers: deliveries/s", "/s", True, None, 0),
    Row("fanout_rss_before", "1,000 SSE subscribers: server RSS before", "MiB", False, None),
    Row(
        "fanout_rss_during", "1,000 SSE subscribers: server RSS during (median)", "MiB", False, None
    ),
    Row("fanout_rss_per_sub", "1,000 SSE subscribers: RSS per idle subscriber", "KiB", False, None),
    Row("creates", "300 concurrent creates (PUT), wall time", "ms", False, 1.0, 0),
    Row("many_streams", "1,000 streams, 64 writers, 100 B", "msg/s", True, 2.0, 0),
    Row("up_rtt", "TS client (a): append -> long-poll receive p50", "ms", False, 0.8, 2),
    Row("up_cycle", "TS client (a): create..delete iteration p50", "ms", False, 0.8, 1),
    Row("up_small", "TS client (b): 1,000 x 100 B, 75 in flight", "msg/s", True, 1.5, 0),
    Row("up_large", "TS client (c): 50 x 1 MiB, 15 in flight", "msg/s", True, 1.5, 1),
    Row("up_small_warmup", "TS client (b): its warm-up iterations", "msg/s", True, None, 0),
    Row("up_large_warmup", "TS client (c): its warm-up iterations", "msg/s", True, None, 1),
]

# What --ceiling runs on bench/js/null-server.mjs: the workloads bound by one request's
# latency, whose goals could lie beyond what the client and the machine allow at all.
CEILING_WORKLOADS = ("rtt", "long-poll", "upstream")

WORKLOADS: dict[str, type[Workload]] = {
    "own-streams": OwnStreams,
    "idempotent": Idempotent,
    "append-64k": Append64K,
    "append-1m": Append1M,
    "catchup-json": CatchUpJson,
    "catchup-binary": CatchUpBinary,
    "rtt": Rtt,
    "sse": Sse,
    "long-poll": LongPoll,
    "fanout": Fanout,
    "creates": Creates,
    "many-streams": ManyStreams,
    "upstream": Upstream,
}


def fmt(value: float | None, row: Row) -> str:
    if value is None:
        return "n/a"
    if value == math.inf:
        return "undelivered"
    return f"{value:,.{row.digits}f} {row.unit}"


def render(
    results: dict[str, dict[str, list[float]]], rows: list[Row], tolerance: float | None = None
) -> str:
    """The table; with ``tolerance`` (--versus) the other server is ours too, and each goal is
    to be within that fraction of it."""
    other = "node" if tolerance is None else "versus"
    ceiling = any(results.get("ceiling", {}).values())
    table = [["workload", "ours", other, f"ours/{other}", "better", "goal", "met"]]
    if ceiling:
        table[0].append(f"ceiling/{other}")
    for row in rows:
        ours = [v for v in results["ours"].get(row.key, []) if v is not None]
        node = [v for v in results["node"].get(row.key, []) if v is not None]
        if not ours and not node and row.key not in results["ours"]:
            continue
        o = statistics.median(ours) if ours else None
        n = statistics.median(node) if node else None
        ratio = o / n if o is not None and n and math.isfinite(o) and math.isfinite(n) else None
        if o is not None and n is not None and math.isinf(o) != math.isinf(n):
            ratio = math.inf if math.isinf(o) else 0.0
        if tolerance is not None:
            row = replace(row, goal=1 - tolerance if row.higher_is_better else 1 + tolerance)
        if row.goal is None:
            goal, met = "report", "-"
        else:
            goal = f"{'>=' if row.higher_is_better else '<='} {row.goal:g}x"
            if ratio is None:
                met = "n/a"
            elif row.higher_is_better:
                met = "yes" if ratio >= row.goal else "NO"
            else:
                met = "yes" if ratio <= row.goal else "NO"
        table.append(
            [
                row.label,
                fmt(o, row),
                fmt(n, row),
                f"{ratio:.2f}x" if ratio is not None else "n/a",
                "higher" if row.higher_is_better else "lower",
                goal,
                met,
            ]
        )
        if ceiling:
            table[-1].append(_ceiling_ratio(results, row, n))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    right = {1, 2, 3, 7}

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in
                         enumerate(zip(cells, widths, strict=True)))
            + " |"
        )  # fmt: skip

    separator = "|" + "|".join(
        ("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths)
    ) + "|"  # fmt: skip
    return "\n".join([line(table[0]), separator, *(line(r) for r in table[1:])])


def _ceiling_ratio(results: dict[str, dict[str, list[float]]], row: Row, n: float | None) -> str:
    """The best ours/node any server could reach on this row (--ceiling), and "beyond" when
    the goal asks for more than that."""
    values = [v for v in results["ceiling"].get(row.key, []) if v is not None]
    if not values or not n or not math.isfinite(n):
        return ""
    best = statistics.median(values) / n
    beyond = row.goal is not None and (best < row.goal if row.higher_is_better else best > row.goal)
    return f"{best:.2f}x" + (" beyond" if beyond else "")


def render_cpu(cpu: dict[str, dict[str, list[Timed]]]) -> str:
    out = [
        "CPU seconds in the timed parts, summed over runs (client: this process and its",
        "children, i.e. the aiohttp client, the fan-out subscribers, the Node client script):",
    ]
    for workload, by_target in cpu.items():
        for name, parts in by_target.items():
            wall = sum(p.wall for p in parts)
            client = sum(p.client for p in parts)
            server = [p.server for p in parts if p.server is not None]
            db = [p.db for p in parts if p.db is not None]
            text = f"  {workload:15s} {name:7s} wall {wall:6.1f} s  client {client:6.1f} s"
            text += f" ({100 * client / wall:3.0f}% of a core)" if wall else ""
            text += f"  server {sum(server):6.1f} s" if server else "  server    n/a"
            text += f"  postgres {sum(db):5.1f} s" if db else ""
            notes = [p.note for p in parts if p.note]
            if notes:
                text += "  [" + "; ".join(notes) + "]"
            out.append(text)
    return "\n".join(out)


async def run_all(args: argparse.Namespace, targets: dict[str, Target]) -> dict[str, Any]:
    chosen = [w for w in WORKLOADS if w in args.only]
    results: dict[str, dict[str, list[float]]] = {
        n: defaultdict(list) for n in ("ours", "node", "ceiling")
    }
    cpu: dict[str, dict[str, list[Timed]]] = defaultdict(lambda: defaultdict(list))
    prefix = f"cmp-{uuid.uuid4().hex[:8]}"
    load_start = machine_load()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)  # both servers drop at 5 s
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=client_headers()
    ) as session:
        for run in range(args.runs):
            for index, workload in enumerate(chosen):
                order = ["ours", "node"] if (run + index) % 2 == 0 else ["node", "ours"]
                if "ceiling" in targets and workload in CEILING_WORKLOADS:
                    order.append("ceiling")
                kind = WORKLOADS[workload]
                started = time.perf_counter()
                contexts = {
                    name: Context(
                        session,
                        targets[name],
                        args.quick,
                        f"{prefix}/{name}/r{run}/{workload}",
                        args.fanout_subscribers,
                    )
                    for name in order
                }
                runs = {name: kind(contexts[name]) for name in order}
                for name in order:
                    await runs[name].prepare()
                for part in range(kind.slices):  # ours, node, node, ours, ...
                    for name in order if part % 2 == 0 else order[::-1]:
                        await runs[name].measure(part, kind.slices)
                for name in order:
                    figures = await runs[name].finish()
                    print(
                        f"run {run + 1}/{args.runs} {workload:15s} {name:5s} "
                        f"{machine_load()}  "
                        + "  ".join(f"{k}={v:.4g}" for k, v in figures.items() if v is not None),
                        file=sys.stderr,
                        flush=True,
                    )
                    for key, value in figures.items():
                        results[name][key].append(value)
                    cpu[workload][name].append(contexts[name].timed_parts)
                print(
                    f"run {run + 1}/{args.runs} {workload:15s} both  "
                    f"{time.perf_counter() - started:5.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    rows = [r for r in ROWS if r.key in results["ours"] or r.key in results["node"]]
    print()
    versus = f"versus ({' '.join(args.versus)})" if args.versus else "node"
    print(
        f"ours: {targets['ours'].base_url}   {versus}: {targets['node'].base_url}   "
        f"runs: {args.runs}{'   QUICK' if args.quick else ''}   (medians over runs)"
        f"\nmachine: {load_start} at start, {machine_load()} at end"
    )
    if "ceiling" in targets:
        print(f"ceiling (bench/js/null-server.mjs): {targets['ceiling'].base_url}")
    print(render(results, rows, args.tolerance if args.versus else None))
    print()
    print(render_cpu(cpu))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default=",".join(WORKLOADS),
        help=f"comma-separated workloads (default: all of {','.join(WORKLOADS)})",
    )
    parser.add_argument("--runs", type=int, default=1, help="repeat everything N times")
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument("--ours-url", help="use this already running server instead")
    parser.add_argument("--node-url", help="use this already running Node server instead")
    parser.add_argument(
        "--node-max-file-handles",
        type=int,
        default=4096,
        help="open segment files the Node file store may keep (its own default, 0 here, is 100:"
        " then appends to more than ~100 streams at once can fail with 404)",
    )
    parser.add_argument(
        "--fanout-subscribers", type=int, default=1000, help="SSE subscribers of 'fanout'"
    )
    parser.add_argument("--json", help="also write every figure of every run here")
    parser.add_argument(
        "--versus",
        nargs="+",
        metavar="NAME=VALUE",
        help="compare against this server with these settings instead of Node (e.g. "
        "DS_METRICS__ENABLED=false, or DS_AUTH__MODE=open with --auth keys)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="with --versus, the goal: ours within this fraction of the other (default 0.05)",
    )
    parser.add_argument(
        "--incompressible",
        action="store_true",
        help="pad records with random letters instead of dots (what compression cannot shrink)",
    )
    parser.add_argument(
        "--auth",
        choices=["open", "keys"],
        default="open",
        help="this server's access mode: keys makes every client send an API key",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also run the latency workloads (" + ", ".join(CEILING_WORKLOADS) + ") on "
        "bench/js/null-server.mjs, which stores nothing: the best any server could do with this "
        "client on this machine, as a ratio to node",
    )
    parser.add_argument(
        "--logs",
        help="keep the servers' logs here (default: a temporary directory, removed "
        "after a successful run)",
    )
    args = parser.parse_args()
    args.only = args.only.split(",")
    if args.incompressible:
        os.environ[INCOMPRESSIBLE_ENV] = "1"  # the TypeScript client script reads it too
    unknown = set(args.only) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload(s): {', '.join(sorted(unknown))}")

    logs = Path(args.logs or tempfile.mkdtemp(prefix="ds-bench-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    servers: list[OursServer | NodeServer | NullServer] = []
    targets: dict[str, Target] = {}
    taken: set[int] = set()
    succeeded = False
    try:
        if args.ours_url:
            targets["ours"] = Target("ours", args.ours_url.rstrip("/"))
        else:
            ours = OursServer(free_port(taken), logs, args.auth)
            taken.add(ours.port)
            servers.append(ours)
            targets["ours"] = ours.start()
        if args.versus:
            # The other side is this server too, with the settings given: its own database.
            settings = dict(item.split("=", 1) for item in args.versus)
            versus = OursServer(free_port(taken), logs, args.auth, name="versus", env=settings)
            taken.add(versus.port)
            servers.append(versus)
            targets["node"] = versus.start()
        elif args.node_url:
            targets["node"] = Target("node", args.node_url.rstrip("/"))
        else:
            node = NodeServer(free_port(taken), logs, args.node_max_file_handles)
            servers.append(node)
            targets["node"] = node.start()
        if args.ceiling:
            null = NullServer(free_port(taken), logs)
            servers.append(null)
            targets["ceiling"] = null.start()
        print(f"server logs: {logs}", file=sys.stderr)
        coroutine = run_all(args, targets)
        try:
            import uvloop
        except ImportError:
            results = asyncio.run(coroutine)
        else:
            results = uvloop.run(coroutine)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        succeeded = True
        return 0
    finally:
        for server in reversed(servers):
            server.stop()
        if succeeded and not args.logs:
            shutil.rmtree(logs, ignore_errors=True)  # kept when something failed


if __name__ == "__main__":
    sys.exit(main())
