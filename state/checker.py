"""Schema checks of appends in processes of their own, each under a deadline.

jsonschema-rs holds Python's global lock while it checks a value, and how long a check takes
depends on the schema and the value in ways no static bound captured: a pattern whose lazy DFA
thrashes (``a[ab]{50}c``: 860 ns a byte, where most patterns take 1-2) or ``multipleOf`` on
4,000-digit integers cost hundreds of times what ``state.core.schema_cost`` counts, and one
append stopped every request of its worker for seconds, until uvicorn killed the worker as
unresponsive (found by probes). So appends to streams with schemas are judged by a small pool
of child processes (``CHECKERS`` per server process): the event loop only waits for the answer,
and a check that overruns its deadline (``DS_STATE__CHECK_TIMEOUT_SECS``, plus a second per MiB
of the append) has its process killed and replaced, and the append is refused (400). The cost
bound still applies inside, and still guards the materializers, which run in-process.

A child keeps the compiled schemas of the registrations it saw (the least recently used 64),
keyed by stream path and registration version; it is sent a registration's schemas only when
it asks. It reads the messages themselves (bytes: no pickling of values), and answers the first
refusal, or None.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from django.conf import settings

from streams import metrics

logger = logging.getLogger(__name__)

CHECKERS = 2
_CACHED_REGISTRATIONS = 64
_SECS_PER_MIB = 1.0


class CheckTimeout(Exception):
    """The check overran its deadline; its process was replaced."""


async def check(
    path: str, version: int, schemas: dict[str, Any], messages: list[bytes]
) -> str | None:
    """Why the append of ``messages`` to the state stream at ``path`` (registration
    ``version``, its ``schemas``) is refused, naming the event; None when it is not.
    CheckTimeout when the check overran its deadline."""
    size = sum(len(message) for message in messages)
    deadline = settings.DS_STATE_CHECK_TIMEOUT_SECS + _SECS_PER_MIB * size / 2**20
    child = await _pool().take()
    try:
        answer = await asyncio.wait_for(
            asyncio.to_thread(child.ask, (path, version), schemas, messages), deadline
        )
    except TimeoutError:
        child.kill()
        metrics.STATE_CHECK_TIMEOUTS.inc()
        logger.warning("schema check of an append to %s overran %.1f s", path, deadline)
        raise CheckTimeout(f"{deadline:.1f}") from None
    except BaseException:
        child.kill()
        raise
    finally:
        _pool().give_back(child)
    return answer


class _Child:
    """One checking process and its end of the pipe; replaced when killed."""

    def __init__(self) -> None:
        self.process: Any = None
        self.conn: Connection | None = None

    def _start(self) -> Connection:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child,), name="ds-schema-check", daemon=True
        )
        self.process.start()
        child.close()
        self.conn = parent
        return parent

    def ask(self, key: tuple[str, int], schemas: dict[str, Any], messages: list[bytes]) -> Any:
        """Blocking: one round trip (two when the child does not know the registration)."""
        conn = self.conn if self.conn is not None and self.alive() else self._start()
        conn.send((key, None, messages))
        kind, detail = conn.recv()
        if kind == "unknown":
            conn.send((key, schemas, messages))
            kind, detail = conn.recv()
        if kind == "error":
            raise RuntimeError(detail)
        return detail

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(Exception):
                self.process.kill()
                self.process.join(1)
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
        self.process = None
        self.conn = None


class _Pool:
    def __init__(self) -> None:
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        for _ in range(CHECKERS):
            self._idle.put_nowait(_Child())

    async def take(self) -> _Child:
        return await self._idle.get()

    def give_back(self, child: _Child) -> None:
        self._idle.put_nowait(child)


_pools: dict[int, _Pool] = {}


def _pool() -> _Pool:
    """This process's pool (a child process of uvicorn's gets its own)."""
    pool = _pools.get(os.getpid())
    if pool is None:
        pool = _pools[os.getpid()] = _Pool()
    return pool


def _serve(conn: Connection) -> None:
    """The child's loop: judge appends until the parent goes away."""
    from state.core import InvalidEvent, parse_event
    from state.core.schemas import SchemaError, compile_schemas, rejection

    compiled: OrderedDict[tuple[str, int], Any] = OrderedDict()
    while True:
        try:
            key, schemas, messages = conn.recv()
        except (EOFError, OSError):
            return
        validators = compiled.get(key)
        if validators is None and schemas is None:
            conn.send(("unknown", None))
            continue
        try:
            if validators is None:
                try:
                    validators = compile_schemas(schemas)
                except (SchemaError, RecursionError):  # checked at registration
                    validators = {}
                compiled[key] = validators
                while len(compiled) > _CACHED_REGISTRATIONS:
                    compiled.popitem(last=False)
            compiled.move_to_end(key)
            refusal = None
            for index, message in enumerate(messages):
                try:
                    event = parse_event(json.loads(message))
                except (InvalidEvent, ValueError) as exc:
                    refusal = f"event {index}: not a valid state event: {exc}"
                    break
                reason = rejection(event, message, validators)
                if reason is not None:
                    refusal = f"event {index}: {reason}"
                    break
            conn.send(("answer", refusal))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which answers it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
