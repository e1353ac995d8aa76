"""A TCP proxy to PostgreSQL that can stall the connections it carries.

``freeze()`` stops forwarding, both ways, on the connections open at that moment (or on those
whose client has sent a given marker, such as ``LISTEN``) without closing them: their sockets
stay open and whatever either side sends is held. That is a half-open connection as a dead
NAT entry, a failed-over load balancer or a frozen VM leaves it: no error, no FIN, just
silence. Connections opened later are forwarded normally.

It runs on an asyncio loop in a background thread of the test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable


class _Link:
    """One client connection and its connection upstream."""

    def __init__(self, writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        self.writers = writers
        self.frozen = False
        self._sent = b""  # the tail of what the client sent, to find a marker across chunks
        self.markers: set[bytes] = set()

    def client_sent(self, data: bytes, watch: tuple[bytes, ...]) -> None:
        window = self._sent + data
        for marker in watch:
            if marker in window:
                self.markers.add(marker)
        self._sent = window[-64:]


class StallingProxy:
    WATCH = (b"LISTEN",)

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.links: list[_Link] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> StallingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def url(self, database_url: str) -> str:
        """``database_url`` (postgres://user@127.0.0.1:PORT/db) through this proxy."""
        host_port = f"{self.target[0]}:{self.target[1]}"
        assert host_port in database_url, database_url
        return database_url.replace(host_port, f"127.0.0.1:{self.port}")

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        link = _Link((client_w, upstream_w))
        self.links.append(link)
        for task in (
            self._pump(client_r, upstream_w, link, from_client=True),
            self._pump(upstream_r, client_w, link, from_client=False),
        ):
            running = asyncio.ensure_future(task)
            self._tasks.add(running)
            running.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        link: _Link,
        *,
        from_client: bool,
    ) -> None:
        try:
            while True:
                data = await source.read(65536)
                if link.frozen:
                    # Hold this and everything after it, and keep both sockets open.
                    await asyncio.Event().wait()
                if not data:
                    break
                if from_client:
                    link.client_sent(data, self.WATCH)
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not link.frozen:
                with contextlib.suppress(Exception):
                    sink.close()

    def freeze(self, marker: bytes | None = None) -> int:
        """Stall every open connection (or those whose client sent ``marker``); how many."""

        def freeze() -> int:
            chosen = [
                link
                for link in self.links
                if not link.frozen and not link.writers[0].is_closing()
                and (marker is None or marker in link.markers)
            ]  # fmt: skip
            for link in chosen:
                link.frozen = True
            return len(chosen)

        return self._call(freeze)

    def open_links(self, marker: bytes | None = None) -> int:
        """Connections open and forwarding (with ``marker``, only those that sent it)."""

        def count() -> int:
            return sum(
                1
                for link in self.links
                if not link.frozen and not link.writers[0].is_closing()
                and (marker is None or marker in link.markers)
            )  # fmt: skip

        return self._call(count)

    def _call(self, function: Callable[[], int]) -> int:
        """Run ``function`` on the proxy's loop (its links are the loop's alone)."""

        async def run() -> int:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for link in self.links:
                for writer in link.writers:
                    with contextlib.suppress(Exception):
                        writer.close()
            for task in list(self._tasks):
                task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
