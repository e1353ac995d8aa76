"""Live delivery: wake waiting readers when a stream changes (DESIGN.md, Live delivery).

One LISTEN connection per server process, on channel ``ds_streams``; the write functions
``pg_notify`` ``"<stream id>:<next seq>:<o|c|d>"`` (open, closed, deleted) on commit. A local
append also publishes directly, so a reader in the same process is woken without the round trip.
Notifications are hints without data: a woken reader re-reads the store.

Readers subscribe BEFORE they read and wait after, so a change between the read and the wait is
never missed. While a subscription waits it holds no database connection. If the LISTEN
connection drops, it reconnects with backoff and wakes every waiter once (they re-read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import psycopg

logger = logging.getLogger(__name__)

CHANNEL = "ds_streams"


class Subscription:
    """Interest in one stream's changes. ``arm()`` before each read, ``wait()`` after it."""

    __slots__ = ("_event", "stream_id")

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self._event = asyncio.Event()

    def arm(self) -> None:
        self._event.clear()

    def wake(self) -> None:
        self._event.set()

    async def wait(self, timeout: float | None) -> bool:
        """True when the stream changed since ``arm()``, False on timeout."""
        if self._event.is_set():
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            return False
        return True


class LiveHub:
    def __init__(self) -> None:
        self._subscriptions: dict[int, set[Subscription]] = {}
        # Highest (next_seq, state) seen per watched stream, so the NOTIFY that follows a local
        # publish of the same change does not wake readers a second time.
        self._seen: dict[int, tuple[int, str]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.asynccontextmanager
    async def subscribe(self, stream_id: int) -> AsyncIterator[Subscription]:
        await self._ensure_listener()
        subscription = Subscription(stream_id)
        self._subscriptions.setdefault(stream_id, set()).add(subscription)
        try:
            yield subscription
        finally:
            subscribers = self._subscriptions.get(stream_id)
            if subscribers is not None:
                subscribers.discard(subscription)
                if not subscribers:
                    del self._subscriptions[stream_id]
                    self._seen.pop(stream_id, None)

    def publish(self, stream_id: int, next_seq: int, closed: bool) -> None:
        self._changed(stream_id, next_seq, "c" if closed else "o")

    def publish_deleted(self, stream_id: int) -> None:
        self._changed(stream_id, -1, "d")

    def _changed(self, stream_id: int, next_seq: int, state: str) -> None:
        subscribers = self._subscriptions.get(stream_id)
        if not subscribers:
            return
        seen = self._seen.get(stream_id)
        if seen is not None and state == seen[1] and next_seq <= seen[0]:
            return
        self._seen[stream_id] = (max(next_seq, seen[0]) if seen else next_seq, state)
        for subscription in subscribers:
            subscription.wake()

    def _wake_all(self) -> None:
        self._seen.clear()
        for subscribers in self._subscriptions.values():
            for subscription in subscribers:
                subscription.wake()

    def _on_notify(self, payload: str) -> None:
        try:
            stream_id, next_seq, state = payload.split(":")
            self._changed(int(stream_id), int(next_seq), state)
        except ValueError:
            logger.warning("ignoring malformed notification %r", payload)

    async def _ensure_listener(self) -> None:
        loop = asyncio.get_running_loop()
        if self._listener is None or self._loop is not loop:
            self._loop = loop
            self._listening = asyncio.Event()
            self._listener = loop.create_task(self._listen(), name="ds-live-listener")
        if not self._listening.is_set():
            # First subscriber: wait (briefly) until LISTEN is active, so that nothing committed
            # between its read and its wait is missed. If the database is down, go on: the
            # reconnect wakes everyone.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._listening.wait()

    async def _listen(self) -> None:
        from streams.store.pool import conninfo

        backoff = 0.1
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(conninfo(), autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self._listening.set()
                    self._wake_all()
                    backoff = 0.1
                    logger.info("listening for stream changes")
                    async for notify in conn.notifies():
                        self._on_notify(notify.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect on any failure
                self._listening.clear()
                logger.warning("LISTEN connection lost (%s); reconnecting in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)


hub = LiveHub()
