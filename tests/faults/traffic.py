"""Traffic that keeps going while the suite breaks things, and the checks of what was stored.

``Producer``: an idempotent producer (PROTOCOL.md 5.2.1: Producer-Id, Producer-Epoch,
Producer-Seq) appending one JSON message per request to its stream, through whichever server
answers. Every request is retried with the same seq until it is acknowledged: 200 (stored
now) or 204 (a duplicate: an earlier attempt of it was stored). A 503 is retried after its
Retry-After (at most ``MAX_RETRY_WAIT``); a connection error or timeout at once, on the next
server. Every attempt is recorded (``Attempt``) so the tests can judge what clients saw.

``SseReader``: follows a stream with SSE from ``-1`` and, when its connection ends for any
reason, reconnects from the ``streamNextOffset`` of the last control event it received; data is
kept only once its control event arrived, as a client must (PROTOCOL.md 5.8).

``Traffic`` runs them on an event loop of their own in a background thread, so the test's
thread is free to kill processes and stop PostgreSQL meanwhile.

``verify`` reads every stream back by offset and counts what was acknowledged, stored, lost,
duplicated and reordered.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

# A 503 asks to retry after Retry-After seconds; the producers wait that, but at most this.
MAX_RETRY_WAIT = 1.0
# One attempt gives up after this long (the server must answer much sooner: a hang is a bug).
ATTEMPT_TIMEOUT = 40.0


@dataclass(frozen=True, slots=True)
class Attempt:
    """One HTTP request as a client saw it."""

    kind: str  # "append" or "sse"
    target: str
    started: float  # time.monotonic()
    ended: float
    status: int | None  # None: no HTTP answer (connection refused or reset, timeout)
    error: str | None = None
    retry_after: str | None = None
    detail: str | None = None  # the error's message

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Producer:
    """One idempotent producer and what the server acknowledged to it."""

    name: str
    path: str  # the stream, e.g. "faults/kill/3"
    primary: int  # index of the server it tries first
    pace: float = 0.02  # pause between appends, to keep the load bounded
    acked: int = 0  # seqs 0..acked-1 are acknowledged
    offsets: dict[int, str] = field(default_factory=dict)  # seq -> Stream-Next-Offset of a 200
    duplicate_acks: int = 0  # 204: an earlier attempt of that seq had been stored
    retried: int = 0  # requests that needed more than one attempt
    failures: list[str] = field(default_factory=list)  # answers no client should ever get

    def message(self, seq: int) -> dict[str, Any]:
        return {"p": self.name, "s": seq}

    async def run(
        self,
        session: aiohttp.ClientSession,
        targets: Callable[[], Sequence[str]],
        stop: asyncio.Event,
        attempts: list[Attempt],
    ) -> None:
        seq = 0
        while not stop.is_set() and not self.failures:
            await self._append(session, targets, seq, attempts)
            seq += 1
            await asyncio.sleep(self.pace)

    async def _append(
        self,
        session: aiohttp.ClientSession,
        targets: Callable[[], Sequence[str]],
        seq: int,
        attempts: list[Attempt],
    ) -> None:
        """Send seq until it is acknowledged (or an answer shows the server broke the
        protocol, which is recorded in ``failures``)."""
        headers = {
            "Content-Type": "application/json",
            "Producer-Id": self.name,
            "Producer-Epoch": "0",
            "Producer-Seq": str(seq),
        }
        body = json.dumps(self.message(seq))
        tries = 0
        while True:
            servers = targets()
            base = servers[(self.primary + tries) % len(servers)]
            tries += 1
            started = time.monotonic()
            try:
                async with session.post(
                    f"{base}/v1/stream/{self.path}", data=body, headers=headers
                ) as response:
                    await response.read()
                    status = response.status
                    retry_after = response.headers.get("Retry-After")
                    answer = response.headers.copy()
            except (aiohttp.ClientError, TimeoutError) as exc:
                ended = time.monotonic()
                error = type(exc).__name__
                attempts.append(
                    Attempt("append", base, started, ended, None, error, None, str(exc))
                )
                await asyncio.sleep(min(0.02 * tries, 0.5))
                continue
            attempts.append(
                Attempt("append", base, started, time.monotonic(), status, None, retry_after)
            )
            if tries > 1 and status in (200, 204):
                self.retried += 1
            if status == 200:
                if answer.get("Producer-Seq") != str(seq):
                    self.failures.append(f"seq {seq}: 200 with Producer-Seq {answer!r}")
                self.offsets[seq] = answer["Stream-Next-Offset"]
                self.acked = seq + 1
                return
            if status == 204:
                # Idempotent success: only a retry may be a duplicate.
                if tries == 1:
                    self.failures.append(f"seq {seq}: 204 on its first attempt")
                self.duplicate_acks += 1
                self.acked = seq + 1
                return
            if status == 503:
                wait = MAX_RETRY_WAIT
                with contextlib.suppress(TypeError, ValueError):
                    wait = min(float(retry_after), MAX_RETRY_WAIT)  # type: ignore[arg-type]
                await asyncio.sleep(wait)
                continue
            # 409 (a sequence gap), 403, 400, any 500: the server lost track of the producer
            # or failed. Recorded and retried (a 500 may be transient), never acknowledged.
            self.failures.append(f"seq {seq}: {status} from {base}")
            if status < 500:
                return
            await asyncio.sleep(0.1)


@dataclass
class SseReader:
    """Follows one stream with SSE through one server, reconnecting whenever it ends."""

    name: str
    base_url: str
    path: str
    offset: str = "-1"
    messages: list[Any] = field(default_factory=list)
    connections: int = 0
    controls: int = 0  # control events received
    clean_ends: int = 0  # responses that ended with a complete body
    broken_ends: int = 0  # connections that failed (reset, incomplete body) or were refused
    refusals: Counter[int] = field(default_factory=Counter)  # non-200 answers, by status

    async def run(self, session: aiohttp.ClientSession, attempts: list[Attempt]) -> None:
        url = f"{self.base_url}/v1/stream/{self.path}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=ATTEMPT_TIMEOUT)
        while True:
            started = time.monotonic()
            status: int | None = None
            retry_after: str | None = None
            try:
                params = {"offset": self.offset, "live": "sse"}
                async with session.get(url, params=params, timeout=timeout) as response:
                    status = response.status
                    retry_after = response.headers.get("Retry-After")
                    if status == 200:
                        self.connections += 1
                        await self._follow(response.content)
                        self.clean_ends += 1
                    else:
                        await response.read()
                        self.refusals[status] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.broken_ends += 1
                error = type(exc).__name__
                ended = time.monotonic()
                attempts.append(
                    Attempt("sse", self.base_url, started, ended, status, error, None, str(exc))
                )
                await asyncio.sleep(0.1)
                continue
            attempts.append(
                Attempt("sse", self.base_url, started, time.monotonic(), status, None, retry_after)
            )
            if status == 503:
                await asyncio.sleep(MAX_RETRY_WAIT)
            elif status != 200:
                await asyncio.sleep(0.2)

    async def _follow(self, content: aiohttp.StreamReader) -> None:
        event: str | None = None
        data: list[str] = []
        pending: list[Any] | None = None
        async for raw in content:
            line = raw.decode().rstrip("\n").rstrip("\r")
            if line.startswith(":"):
                continue  # a keep-alive comment
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(" ") else value)
            elif line == "" and event is not None:
                payload = json.loads("\n".join(data))
                if event == "data":
                    pending = payload
                elif event == "control":
                    if pending is not None:
                        self.messages.extend(pending)
                        pending = None
                    self.offset = payload["streamNextOffset"]
                    self.controls += 1
                event, data = None, []


class Traffic:
    """Producers and SSE readers on an event loop in a background thread."""

    def __init__(
        self,
        producers: Sequence[Producer],
        targets: Callable[[], Sequence[str]],
        readers: Sequence[SseReader] = (),
    ) -> None:
        self.producers = list(producers)
        self.readers = list(readers)
        self.targets = targets
        self.attempts: list[Attempt] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_producers: asyncio.Event | None = None
        self._producers_done = threading.Event()
        self._stop_readers: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-traffic", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Traffic:
        self._thread.start()
        self._started.wait(10)
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc
            self._producers_done.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_producers = asyncio.Event()
        self._stop_readers = asyncio.Event()
        # Idle connections are dropped well before the server's keep-alive timeout (uvicorn's
        # 5 s): reusing one the server is closing at that moment fails with no fault at all.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        timeout = aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            readers = [
                asyncio.create_task(reader.run(session, self.attempts)) for reader in self.readers
            ]
            self._started.set()
            await asyncio.gather(
                *(
                    producer.run(session, self.targets, self._stop_producers, self.attempts)
                    for producer in self.producers
                )
            )
            self._producers_done.set()
            await self._stop_readers.wait()
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    def acknowledged(self) -> int:
        return sum(producer.acked for producer in self.producers)

    def wait_acknowledged(self, more: int, timeout: float, what: str) -> None:
        """Wait until ``more`` appends beyond the current count are acknowledged."""
        from tests.faults.processes import wait_for

        goal = self.acknowledged() + more
        wait_for(lambda: self.acknowledged() >= goal or self.error, timeout, what)
        if self.error:
            raise self.error

    def stop_producers(self, timeout: float = 120) -> None:
        """Let every producer finish the request it is sending (retrying until it is
        acknowledged) and stop."""
        assert self._loop is not None and self._stop_producers is not None
        self._loop.call_soon_threadsafe(self._stop_producers.set)
        assert self._producers_done.wait(timeout), "producers did not finish"
        if self.error:
            raise self.error

    def stop(self) -> None:
        if self._loop is not None and self._stop_producers is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop_producers.set)
        self._producers_done.wait(120)
        if self._loop is not None and self._stop_readers is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop_readers.set)
        self._thread.join(30)


def read_stream(base_url: str, path: str) -> tuple[list[Any], str, dict[str, int]]:
    """Every message of a JSON stream, read by offset from -1 in chunks; the tail offset; and
    for each chunk's Stream-Next-Offset, how many messages precede it."""
    messages: list[Any] = []
    boundaries: dict[str, int] = {}
    offset = "-1"
    with httpx.Client(timeout=30) as client:
        while True:
            response = client.get(f"{base_url}/v1/stream/{path}", params={"offset": offset})
            assert response.status_code == 200, (response.status_code, response.text)
            messages.extend(response.json())
            following = response.headers["Stream-Next-Offset"]
            assert offset == "-1" or following > offset, "offsets must move forward"
            offset = following
            boundaries[offset] = len(messages)
            if response.headers.get("Stream-Up-To-Date") == "true":
                return messages, offset, boundaries


@dataclass
class Figures:
    """What the producers were told, against what the streams hold."""

    acknowledged: int = 0  # appends acknowledged (200, or 204 to a retry)
    stored: int = 0  # messages read back
    lost: int = 0  # acknowledged, not stored
    duplicated: int = 0  # stored more than once (extra copies)
    reordered: int = 0  # a producer's message stored before one it sent earlier
    unexpected: int = 0  # stored, never sent (or not by a producer of this test)
    offset_mismatches: int = 0  # an acknowledged offset that disagrees with the stored order
    retried: int = 0  # appends acknowledged after more than one attempt
    duplicate_acks: int = 0  # retries answered 204: the lost-answer case, deduplicated
    stored_by_stream: dict[str, list[Any]] = field(default_factory=dict, repr=False)
    tails: dict[str, str] = field(default_factory=dict, repr=False)

    def summary(self) -> str:
        return (
            f"acknowledged={self.acknowledged} stored={self.stored} lost={self.lost} "
            f"duplicated={self.duplicated} reordered={self.reordered} "
            f"unexpected={self.unexpected} offset_mismatches={self.offset_mismatches} "
            f"retried={self.retried} duplicate_acks={self.duplicate_acks}"
        )

    def assert_exactly_once(self) -> None:
        assert self.acknowledged > 0
        assert (self.lost, self.duplicated, self.reordered) == (0, 0, 0), self.summary()
        assert (self.unexpected, self.offset_mismatches) == (0, 0), self.summary()
        assert self.stored == self.acknowledged, self.summary()


def verify(base_url: str, producers: Sequence[Producer]) -> Figures:
    """Read every stream back and compare it with what each producer was acknowledged."""
    figures = Figures()
    by_stream: dict[str, list[Producer]] = {}
    for producer in producers:
        by_stream.setdefault(producer.path, []).append(producer)
        figures.acknowledged += producer.acked
        figures.retried += producer.retried
        figures.duplicate_acks += producer.duplicate_acks
    for path, writers in sorted(by_stream.items()):
        stored, tail, boundaries = read_stream(base_url, path)
        figures.stored += len(stored)
        figures.stored_by_stream[path] = stored
        figures.tails[path] = tail
        names = {producer.name: producer for producer in writers}
        seqs: dict[str, list[int]] = {name: [] for name in names}
        for message in stored:
            if not isinstance(message, dict) or message.get("p") not in names:
                figures.unexpected += 1
                continue
            seqs[message["p"]].append(message["s"])
        for name, producer in names.items():
            found = seqs[name]
            counts = Counter(found)
            figures.lost += sum(1 for seq in range(producer.acked) if seq not in counts)
            figures.duplicated += sum(n - 1 for n in counts.values())
            figures.unexpected += sum(1 for seq in counts if not 0 <= seq < producer.acked)
            figures.reordered += sum(1 for a, b in itertools.pairwise(found) if b < a)
        # Offsets acknowledged by 200s sort in the stored order, and one that is a chunk
        # boundary of the read-back sits right after its own message.
        position = {
            (message["p"], message["s"]): index
            for index, message in enumerate(stored)
            if isinstance(message, dict)
        }
        acked = sorted(
            (offset, (producer.name, seq))
            for producer in writers
            for seq, offset in producer.offsets.items()
        )
        order = [position.get(key, -1) for _, key in acked]
        figures.offset_mismatches += sum(1 for a, b in itertools.pairwise(order) if b <= a)
        for offset, key in acked:
            if offset in boundaries and position.get(key, -1) != boundaries[offset] - 1:
                figures.offset_mismatches += 1
            if offset > tail:
                figures.offset_mismatches += 1
    return figures


def create_streams(base_url: str, paths: Sequence[str]) -> None:
    with httpx.Client(timeout=30) as client:
        for path in paths:
            response = client.put(
                f"{base_url}/v1/stream/{path}", headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 201, (response.status_code, response.text)


def statuses(attempts: Sequence[Attempt], kind: str | None = None) -> Counter[str]:
    """How many attempts got each answer ("200", "503", "ConnectionError"...)."""
    return Counter(
        str(attempt.status) if attempt.status is not None else (attempt.error or "error")
        for attempt in attempts
        if kind is None or attempt.kind == kind
    )
