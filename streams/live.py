"""Live delivery: wake waiting readers when a stream changes (DESIGN.md, Live delivery).

One LISTEN connection per server process, on channel ``ds_streams``; the write functions
``pg_notify`` ``"<stream id>:<next seq>:<o|c|d>"`` (open, closed, deleted) on commit, and a
trim ``"<stream id>:-1:t"`` (what is kept of the stream is dropped). A local
append also publishes directly, so a reader in the same process is woken without the round trip.
A small append's notification also carries its data. Data committed by this process, or carried
by a notification, is kept briefly per watched stream (``Appended``); a reader whose offset is
exactly where it starts takes it from memory. Otherwise, and whenever in doubt (a gap, a lost
LISTEN connection, a large append), a woken reader re-reads the store, which stays the
authority (docs/decisions.md).

Readers subscribe BEFORE they read and wait after, so a change between the read and the wait is
never missed. While a subscription waits it holds no database connection. If the LISTEN
connection drops, it reconnects with backoff and wakes every waiter once (they re-read).

Watched streams: an append notifies only while its stream is marked watched
(``ds_stream.watched_until``), so appends nobody follows cost neither PostgreSQL nor any
process a notification (every process receives every notification: 10% of the appends a
server could take, measured). A process marks a stream when a reader subscribes, BEFORE the
reader reads; the mark is an update of the stream's row, which waits for the appends in flight
to commit, so every append either committed before the mark (the read finds it) or sees the
mark (and notifies). Marks last ``WATCH_SECS`` and are renewed every ``WATCH_REFRESH_SECS``
while readers remain; concurrent readers of a stream share one mark.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import psycopg
from django.conf import settings
from psycopg.conninfo import make_conninfo

from streams import metrics
from streams.protocol.offsets import Offset

logger = logging.getLogger(__name__)

CHANNEL = "ds_streams"
# Recent local appends kept per watched stream, the largest one worth keeping, and the bytes
# kept per stream and per process: 64 appends of 256 KiB for each of a client's watched
# streams made 16 MiB a stream, without a bound on their number (probe 9a).
RECENT_APPENDS = 64
RECENT_MAX_BYTES = 256 * 1024
RECENT_STREAM_BYTES = 1024 * 1024
RECENT_TOTAL_BYTES = 64 * 1024 * 1024
# What a kept message costs beyond its bytes (a bytes object and its place in a tuple): counted
# by data alone, 100,000 two-byte JSON messages were 200 KB kept as 4-5 MB (review).
RECENT_MESSAGE_BYTES = 48
# How long a mark keeps a stream watched, and how old a mark is renewed (seconds): a process
# may fail to renew for WATCH_SECS - WATCH_REFRESH_SECS before its readers miss anything.
WATCH_SECS = 60.0
WATCH_REFRESH_SECS = 20.0
# How often the marks of streams still watched are checked for renewal (seconds).
WATCH_CHECK_SECS = 5.0
# How long (ms) the mark of a stream whose row renewals kept finding held waits for it, how
# many such marks a check makes at most, and at once.
URGENT_MARK_WAIT_MS = 1000
URGENT_MARKS_PER_CHECK = 8
URGENT_MARKS_AT_ONCE = 2


@dataclass(frozen=True, slots=True)
class Appended:
    """Messages this process committed to a stream, from ``start`` to ``end``."""

    start: Offset
    end: Offset
    messages: tuple[bytes, ...]
    closed: bool


@dataclass(frozen=True, slots=True)
class LocalDelivery:
    """What a reader at some offset can take from memory: messages up to ``end``."""

    messages: list[bytes]
    end: Offset
    closed: bool
    # True when ``end`` is the newest tail this process knows of.
    up_to_date: bool


class Subscription:
    """Interest in one stream's changes. ``arm()`` before each read, ``wait()`` after it."""

    __slots__ = ("_event", "ended")

    def __init__(self, *, ended: bool = False) -> None:
        self._event = asyncio.Event()
        # The process is shutting down: the reader should answer now and end.
        self.ended = ended

    def arm(self) -> None:
        self._event.clear()

    def wake(self) -> None:
        self._event.set()

    def end(self) -> None:
        self.ended = True
        self._event.set()

    async def wait(self, timeout: float | None) -> bool:
        """True when the stream changed since ``arm()``; False on timeout, or when the
        reader must end (``ended``)."""
        if not self._event.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await self._event.wait()
            except TimeoutError:
                return False
        return not self.ended


@dataclass(slots=True)
class _Kept:
    entries: deque[Appended]
    size: int = 0


def _held(entry: Appended) -> int:
    return entry.end.pos - entry.start.pos + RECENT_MESSAGE_BYTES * len(entry.messages)


class RecentAppends:
    """The appends kept per watched stream (``Appended``), within RECENT_APPENDS and
    RECENT_STREAM_BYTES a stream and RECENT_TOTAL_BYTES in all: past those the oldest go, or,
    for an append the process has no room for, the stream's (its readers re-read the store)."""

    __slots__ = ("_by_stream", "size")

    def __init__(self) -> None:
        self._by_stream: dict[int, _Kept] = {}
        self.size = 0

    def get(self, stream_id: int) -> deque[Appended] | None:
        kept = self._by_stream.get(stream_id)
        return kept.entries if kept is not None else None

    def add(self, stream_id: int, entry: Appended) -> None:
        size = _held(entry)
        if size > RECENT_MAX_BYTES or self.size + size > RECENT_TOTAL_BYTES:
            self.forget(stream_id)  # too big to keep: readers re-read
            return
        kept = self._by_stream.setdefault(stream_id, _Kept(deque()))
        kept.entries.append(entry)
        kept.size += size
        self.size += size
        while len(kept.entries) > RECENT_APPENDS or kept.size > RECENT_STREAM_BYTES:
            gone = _held(kept.entries.popleft())
            kept.size -= gone
            self.size -= gone

    def forget(self, stream_id: int) -> None:
        kept = self._by_stream.pop(stream_id, None)
        if kept is not None:
            self.size -= kept.size

    def clear(self) -> None:
        self._by_stream.clear()
        self.size = 0


class LiveHub:
    def __init__(self) -> None:
        self._subscriptions: dict[int, set[Subscription]] = {}
        # Highest (next_seq, state) seen per watched stream, so the NOTIFY that follows a local
        # publish of the same change does not wake readers a second time.
        self._seen: dict[int, tuple[int, str]] = {}
        self._recent = RecentAppends()
        self._listener: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        # Set once the listener has tried to connect, whatever came of it.
        self._tried = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set at shutdown: every reader ends, and readers arriving later end at once.
        self._closing = False
        # Callbacks for notifications of other kinds ("<kind>:<payload>", kind not a number).
        self._handlers: dict[str, Callable[[str], None]] = {}
        # Called when the LISTEN connection (re)connects: notifications may have been missed.
        self._reconnect_hooks: list[Callable[[], None]] = []
        # When this process last heard from its LISTEN connection (monotonic seconds).
        self.last_heard = 0.0
        # Local commits and their notifications, matched to measure notification lag:
        # (stream id, next seq) -> (which came first: "c"ommit or "n"otify, when).
        self._lag_marks: dict[tuple[int, int], tuple[str, float]] = {}
        # Watched streams: when this process last marked each (monotonic seconds), the marks
        # being written, and the task that renews them.
        self._marked: dict[int, float] = {}
        self._marking: dict[int, asyncio.Future[None]] = {}
        self._renewer: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def subscribe(self, stream_id: int) -> AsyncIterator[Subscription]:
        await self._ensure_listener()
        subscription = Subscription(ended=self._closing)
        self._subscriptions.setdefault(stream_id, set()).add(subscription)
        try:
            await self._watch(stream_id)
            yield subscription
        finally:
            subscribers = self._subscriptions.get(stream_id)
            if subscribers is not None:
                subscribers.discard(subscription)
                if not subscribers:
                    del self._subscriptions[stream_id]
                    self._seen.pop(stream_id, None)
                    self._recent.forget(stream_id)

    def publish(
        self, stream_id: int, next_seq: int, closed: bool, appended: Iterable[Appended] = ()
    ) -> None:
        """A local commit: keep its data for local readers, then wake them."""
        for entry in appended:
            self._remember(stream_id, entry)
        if stream_id in self._subscriptions:  # else no notification comes to match it
            self._mark_lag((stream_id, next_seq), "c")
        self._changed(stream_id, next_seq, "c" if closed else "o")

    def close_readers(self) -> None:
        """Shutdown: end every live reader now (long-polls answer 204, SSE streams end), and
        every reader that arrives from now on after its first read."""
        self._closing = True
        for subscribers in self._subscriptions.values():
            for subscription in subscribers:
                subscription.end()

    def add_handler(self, kind: str, handler: Callable[[str], None]) -> None:
        """Call ``handler(payload)`` for notifications ``"<kind>:<payload>"`` on the channel
        (other apps share this process's LISTEN connection: access control's key changes)."""
        self._handlers[kind] = handler

    def add_reconnect_hook(self, hook: Callable[[], None]) -> None:
        self._reconnect_hooks.append(hook)

    @property
    def listening(self) -> bool:
        return self._listening.is_set()

    def watches(self, stream_id: int) -> bool:
        """Does a reader in this process wait on the stream?"""
        return stream_id in self._subscriptions

    def _wants(self, stream_id: int, first_seq: int) -> bool:
        """Should data starting at ``first_seq`` be kept? Only for watched streams, and only
        once: the same append arrives twice (a local commit and its NOTIFY, in either order),
        and what starts before the end of what is kept is already there, or older."""
        if stream_id not in self._subscriptions:
            return False
        recent = self._recent.get(stream_id)
        return not recent or first_seq >= recent[-1].end.seq

    def _remember(self, stream_id: int, entry: Appended) -> None:
        if not self._wants(stream_id, entry.start.seq):
            return
        self._recent.add(stream_id, entry)

    def local_delivery(
        self, stream_id: int, offset: Offset, max_bytes: int, max_messages: int
    ) -> LocalDelivery | None:
        """The kept messages from exactly ``offset`` on, as far as they are contiguous and
        (after the first append) within ``max_bytes`` and ``max_messages``; None when this
        process does not have the data at ``offset``."""
        recent = self._recent.get(stream_id)
        if not recent:
            return None
        messages: list[bytes] = []
        position = offset
        closed = False
        matched = False
        for entry in recent:
            if matched and (
                entry.end.pos - offset.pos > max_bytes
                or len(messages) + len(entry.messages) > max_messages
            ):
                break
            if entry.start == position:
                messages.extend(entry.messages)
                position = entry.end
                closed = entry.closed
                matched = True
            elif matched or entry.start > position:
                break
        if not matched:
            return None
        # Up to date only if nothing newer was heard of: no later sequence number, and no
        # close that the kept data does not show (a close without data is notified without
        # any, so it is never kept: the reader must re-read the store to see it).
        seen = self._seen.get(stream_id)
        up_to_date = seen is not None and seen[0] <= position.seq and (closed or seen[1] != "c")
        return LocalDelivery(messages, position, closed, up_to_date)

    def _changed(self, stream_id: int, next_seq: int, state: str) -> None:
        subscribers = self._subscriptions.get(stream_id)
        if not subscribers:
            return
        seen = self._seen.get(stream_id)
        if seen is not None and seen[1] != "o" and state == "o":
            state = seen[1]  # a stream once closed stays closed: a late notice cannot reopen it
        if seen is not None and state == seen[1] and next_seq <= seen[0]:
            return
        self._seen[stream_id] = (max(next_seq, seen[0]) if seen else next_seq, state)
        for subscription in subscribers:
            subscription.wake()

    def _mark_lag(self, key: tuple[int, int], side: str) -> None:
        """A local commit ("c") or the notification of one ("n"): once both are seen, the
        time between them is the notification's lag (0 when the notification came first)."""
        now = time.monotonic()
        other = self._lag_marks.pop(key, None)
        if other is None:
            if len(self._lag_marks) >= 10_000:
                self._lag_marks.clear()  # notifications lost: start over
            self._lag_marks[key] = (side, now)
        elif other[0] != side:
            metrics.NOTIFY_LAG.observe(now - other[1] if side == "n" else 0.0)

    async def _remark_all(self) -> None:
        """After a (re)connection: mark every watched stream again before its readers re-read,
        in case the marks ran out while the database was unreachable."""
        if self._subscriptions:
            await self._renew_or_warn(list(self._subscriptions), "reconnect")

    def _wake_all(self) -> None:
        # Notifications may have been missed: what is kept can no longer be known complete.
        self._seen.clear()
        self._recent.clear()
        for hook in self._reconnect_hooks:
            try:
                hook()
            except Exception:
                logger.exception("reconnect hook failed")
        for subscribers in self._subscriptions.values():
            for subscription in subscribers:
                subscription.wake()

    async def _watch(self, stream_id: int) -> None:
        """Make sure the stream is marked watched for a while yet: a database write at most
        every WATCH_REFRESH_SECS per stream, shared by readers subscribing meanwhile."""
        marked = self._marked.get(stream_id)
        if marked is not None and time.monotonic() - marked < WATCH_REFRESH_SECS:
            return
        pending = self._marking.get(stream_id)
        if pending is None:
            pending = asyncio.ensure_future(self._mark([stream_id], "subscribe"))
            self._marking[stream_id] = pending
            pending.add_done_callback(lambda done: self._marking_done(stream_id, done))
        await asyncio.shield(pending)

    def _marking_done(self, stream_id: int, done: asyncio.Future[None]) -> None:
        self._marking.pop(stream_id, None)
        # Retrieved, so a failure every waiter stopped waiting for is not logged as unhandled
        # (each waiter that was still there got it).
        if not done.cancelled():
            done.exception()

    async def _mark(self, stream_ids: list[int], reason: str) -> None:
        from streams.store.writes import watch_streams

        began = time.monotonic()
        try:
            await watch_streams(stream_ids, WATCH_SECS)
        except Exception:
            metrics.WATCH_MARKS.labels(reason, "failed").inc()
            raise
        metrics.WATCH_MARKS.labels(reason, "marked").inc()
        for stream_id in stream_ids:
            self._marked[stream_id] = began

    async def _renew(self) -> None:
        """Renew the marks of the streams this process still watches; forget the others."""
        while True:
            await asyncio.sleep(WATCH_CHECK_SECS)
            now = time.monotonic()
            for stream_id, marked in list(self._marked.items()):
                if stream_id not in self._subscriptions and now - marked >= WATCH_REFRESH_SECS:
                    del self._marked[stream_id]
            metrics.WATCHED_STREAMS.set(len(self._subscriptions))
            due = [
                stream_id
                for stream_id in self._subscriptions
                if now - self._marked.get(stream_id, -WATCH_SECS) >= WATCH_REFRESH_SECS
            ]
            if due:
                await self._renew_or_warn(due, "renew")

    async def _renew_or_warn(self, stream_ids: list[int], reason: str) -> None:
        """Mark again the streams of ``stream_ids`` whose rows nobody else holds (the others
        are tried at the next check, every WATCH_CHECK_SECS; so is everything after a failure,
        which is logged). The readers of a stream whose mark had run out read again."""
        from streams.store.writes import renew_watches

        began = time.monotonic()
        try:
            renewed = await renew_watches(stream_ids, WATCH_SECS)
        except Exception as exc:  # noqa: BLE001 - tried again at the next check
            metrics.WATCH_MARKS.labels(reason, "failed").inc()
            logger.warning(
                "could not mark %d watched streams (%s): %s", len(stream_ids), reason, exc
            )
            return
        metrics.WATCH_MARKS.labels(reason, "marked").inc()
        for stream_id, lapsed in renewed.items():
            self._marked[stream_id] = began
            if lapsed:
                self._heard_nothing(stream_id)
        # A row busy with other processes' appends can be skipped at every check until its
        # mark runs out (review): those whose marks would run out before two more checks are
        # marked waiting for their rows a moment, the oldest first, a few at once, so that
        # rows held for long do not hold the renewal of the others (review).
        soon = began - (WATCH_SECS - 2 * WATCH_CHECK_SECS)
        urgent = sorted(
            (marked, stream_id)
            for stream_id in stream_ids
            if stream_id not in renewed
            and (marked := self._marked.get(stream_id, -math.inf)) <= soon
        )
        gate = asyncio.Semaphore(URGENT_MARKS_AT_ONCE)

        async def mark(stream_id: int) -> None:
            async with gate:
                await self._mark_briefly(stream_id, reason)

        await asyncio.gather(*(mark(i) for _, i in urgent[:URGENT_MARKS_PER_CHECK]))

    def _heard_nothing(self, stream_id: int) -> None:
        """The stream's mark had run out: appends may have committed unnoticed, so what is
        kept is not known complete, and its readers read again."""
        self._seen.pop(stream_id, None)
        self._recent.forget(stream_id)
        for subscription in self._subscriptions.get(stream_id, ()):
            subscription.wake()

    async def _mark_briefly(self, stream_id: int, reason: str) -> None:
        from streams.store.writes import watch_streams

        began = time.monotonic()
        lapsed = began - self._marked.get(stream_id, -math.inf) >= WATCH_SECS - 1
        try:
            await watch_streams([stream_id], WATCH_SECS, lock_wait_ms=URGENT_MARK_WAIT_MS)
        except Exception as exc:  # noqa: BLE001 - tried again at the next check
            metrics.WATCH_MARKS.labels(reason, "failed").inc()
            logger.warning("could not mark watched stream %d (%s): %s", stream_id, reason, exc)
            return
        metrics.WATCH_MARKS.labels(reason, "marked").inc()
        self._marked[stream_id] = began
        if lapsed:
            self._heard_nothing(stream_id)

    async def _poll(self) -> None:
        """While nothing can be heard: read the tails of the streams watched here and wake the
        readers of those that moved, as their notifications would have. The LISTEN connection
        can fail while pooled ones serve (PostgreSQL out of connections): appends were stored
        and acknowledged, and readers here heard nothing (long-polls answered 204 at the old
        tail, SSE readers nothing for 30 s: probe 10i). Every reconnection attempt, so at
        least every 2 s."""
        from streams.store.reads import tails

        if not self._subscriptions:
            return
        watched = list(self._subscriptions)
        try:
            found = await tails(watched)
        except Exception as exc:  # noqa: BLE001 - read again at the next attempt
            logger.debug("could not read the tails of watched streams: %s", exc)
            return
        for stream_id in watched:
            tail = found.get(stream_id)
            if tail is None:
                self._changed(stream_id, -1, "d")
            else:
                self._changed(stream_id, tail[0], "c" if tail[1] else "o")

    def _on_notify(self, payload: str) -> None:
        """``"<id>:<next seq>:<o|c|d|t>"`` (open, closed, deleted, trimmed), and for small
        appends that stored every request
        ``":<first seq>:<first pos>:<lengths, comma-separated>:<base64 data>"``
        (``ds_notify_payload`` in streams/store/sql/functions.sql)."""
        kind = payload.split(":", 1)[0]
        handler = self._handlers.get(kind)
        if handler is not None:
            try:
                handler(payload[len(kind) + 1 :])
            except Exception:
                logger.exception("notification handler %r failed", kind)
            return
        try:
            parts = payload.split(":", 6)
            stream_id, next_seq, state = int(parts[0]), int(parts[1]), parts[2]
            if state == "t":
                # Trimmed: what is kept may be before its new start, and is not to be handed
                # out (probe 8a). Readers at the tail are not woken: nothing new for them.
                self._recent.forget(stream_id)
                return
            if state == "d":
                self._recent.forget(stream_id)
            elif len(parts) == 7 and self._wants(stream_id, int(parts[3])):
                self._remember(stream_id, _notified(parts[3:], closed=state == "c"))
            if (stream_id, next_seq) in self._lag_marks:
                self._mark_lag((stream_id, next_seq), "n")
        except (ValueError, IndexError, binascii.Error):
            logger.warning("ignoring malformed notification %r", payload[:200])
            return
        self._changed(stream_id, next_seq, state)

    async def _ensure_listener(self, *, wait: bool = True) -> None:
        loop = asyncio.get_running_loop()
        if self._listener is None or self._loop is not loop:
            self._loop = loop
            self._listening = asyncio.Event()
            self._tried = asyncio.Event()
            self._listener = loop.create_task(self._listen(), name="ds-live-listener")
        if self._renewer is None or self._renewer.done() or self._renewer.get_loop() is not loop:
            # (Re)started whenever a reader subscribes: without renewals, marks run out and
            # other processes' appends stop reaching this process's readers.
            self._renewer = loop.create_task(self._renew(), name="ds-live-watch-renewal")
        if wait and not self._tried.is_set():
            # First subscriber: wait (briefly) until LISTEN is active, so that nothing committed
            # between its read and its wait is missed. If it cannot be (the database is down,
            # or out of connections), go on: the tails are read meanwhile (_poll), and the
            # reconnect wakes everyone. (Every subscriber waited 5 s while it could not be:
            # probe 10i.)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._tried.wait()

    async def start(self, *, wait: bool = True) -> None:
        """Start listening now (at process start-up) rather than at the first reader; with
        ``wait``, wait (briefly) until LISTEN is active."""
        await self._ensure_listener(wait=wait)

    async def stop(self) -> None:
        for task in (self._listener, self._renewer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._listener = self._renewer = None

    async def _listen(self) -> None:
        from streams.store.pool import conninfo

        backoff = 0.1
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    make_conninfo(
                        conninfo(url=settings.DS_LISTEN_DATABASE_URL), **LISTEN_KEEPALIVES
                    ),
                    autocommit=True,
                )
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    heartbeat = f"ds_heartbeat_{os.getpid()}_{id(self)}"
                    await conn.execute(f"LISTEN {heartbeat}")
                    self.last_heard = time.monotonic()
                    self._listening.set()
                    self._tried.set()
                    await self._remark_all()
                    self._wake_all()
                    backoff = 0.1
                    logger.info("listening for stream changes")
                    await self._receive(conn, heartbeat)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect on any failure
                self._listening.clear()
                self._tried.set()
                stalled = isinstance(exc, ListenStalled)
                metrics.LISTEN_RECONNECTS.labels("stalled" if stalled else "error").inc()
                logger.warning("LISTEN connection lost (%s); reconnecting in %.1fs", exc, backoff)
                await self._poll()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _receive(self, conn: psycopg.AsyncConnection, heartbeat: str) -> None:
        """Deliver notifications, and every ``DS_LISTEN_HEARTBEAT_SECS`` send one to this
        very connection: it travels to the server and back on the same socket, so a
        connection that stalled without an error (a half-open TCP connection, a frozen
        proxy) is noticed when nothing comes back, and replaced (raises ListenStalled)."""
        interval = settings.DS_LISTEN_HEARTBEAT_SECS
        while True:
            async for notify in conn.notifies(timeout=interval):
                self.last_heard = time.monotonic()
                if notify.channel == CHANNEL:
                    self._on_notify(notify.payload)
            silent = time.monotonic() - self.last_heard
            if silent > 2 * interval:
                await conn.close()
                raise ListenStalled(f"nothing heard for {silent:.1f}s")
            # Not cancelled on timeout: cancelling a query waits for the server's answer to the
            # cancel request (5 s). The connection is closed instead (close() takes no lock,
            # unlike the rollback of leaving `async with conn` with an error), which ends it.
            sent = asyncio.ensure_future(conn.execute(f"NOTIFY {heartbeat}"))
            done, _ = await asyncio.wait({sent}, timeout=interval)
            if not done:
                sent.add_done_callback(lambda task: task.cancelled() or task.exception())
                await conn.close()
                raise ListenStalled("the heartbeat got no answer")
            sent.result()


class ListenStalled(Exception):
    """The LISTEN connection stopped answering without failing."""


# TCP keepalives on the LISTEN connection, so the kernel too notices a peer that vanished.
LISTEN_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def _notified(fields: list[str], *, closed: bool) -> Appended:
    first_seq, first_pos, lengths_csv, encoded = fields
    data = base64.b64decode(encoded, validate=True)
    lengths = [int(n) for n in lengths_csv.split(",")] if lengths_csv else []
    if sum(lengths) != len(data):
        raise ValueError("lengths do not match the data")
    messages = []
    at = 0
    for length in lengths:
        messages.append(data[at : at + length])
        at += length
    start = Offset(int(first_seq), int(first_pos))
    end = Offset(start.seq + len(messages), start.pos + len(data))
    return Appended(start, end, tuple(messages), closed)


hub = LiveHub()
