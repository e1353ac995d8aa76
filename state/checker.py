"""Schema checks of appends in processes of their own, each under a deadline.

jsonschema-rs holds Python's global lock while it checks a value, and how long a check takes
depends on the schema and the value in ways no static bound captured: a pattern whose lazy DFA
thrashes (``a[ab]{50}c``: 860 ns a byte, where most patterns take 1-2) or ``multipleOf`` on
4,000-digit integers cost hundreds of times what ``state.core.schema_cost`` counts, and one
append stopped every request of its worker for seconds, until uvicorn killed the worker as
unresponsive (found by probes). So appends to streams whose schemas are not plain
(``state.validation``) are judged by a small pool of child processes (``CHECKERS`` per server
process and event loop, each a ``durable_project.children.Child``): the event loop only waits
for the answer.

A child is started, and a registration's schemas compiled in it, before the check's deadline
starts (within ``SETUP_SECS``: a 503 past it, as when a child dies or cannot start: nothing is
wrong with the append). The check itself has ``DS_STATE__CHECK_TIMEOUT_SECS``, plus a second
per MiB of the append; past it the child is killed and replaced by a new one (never reused:
the thread that waited on it may still hold its pipe), and the append is refused (400). An
error of the check itself refuses the append too (400), and keeps the child.

An append waits for a free checker at most ``DS_STATE__CHECK_TIMEOUT_SECS`` (a 503 past it).

A child keeps the compiled schemas of the registrations it was sent (the least recently used
64), keyed by stream path and registration version; it reads the messages themselves (bytes:
no pickling of values), checks them without the in-process cost budget (the deadline is the
bound), and answers the first refusal, or None.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from django.conf import settings

from durable_project.children import (
    SETUP_SECS,
    Answer,
    Child,
    ChildTimeout,
    ChildUnavailable,
    serve,
)
from streams import metrics
from streams.errors import BadRequest, ServiceUnavailable

logger = logging.getLogger(__name__)

CHECKERS = 2
_CACHED_REGISTRATIONS = 64
_SECS_PER_MIB = 1.0
# The blocking pipe round trips run here, not in the loop's default executor (shared with
# other work that could delay them past their deadline).
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(CHECKERS * 2, thread_name_prefix="ds-check")


class CheckTimeout(Exception):
    """The check overran its deadline (seconds, the message); its process was replaced."""


class CheckUnavailable(Exception):
    """No checker could be started or prepared in time, or it died: retry later."""


@contextlib.contextmanager
def answered(what: str) -> Iterator[None]:
    """CheckTimeout as a refusal of ``what`` (400: it cannot be checked in time), and
    CheckUnavailable as a 503 (nothing is wrong with it: retry)."""
    try:
        yield
    except CheckTimeout as exc:
        raise BadRequest(
            f"{what} could not be checked against its schemas within {exc} s"
        ) from None
    except CheckUnavailable:
        raise ServiceUnavailable("schema checks are unavailable; retry later") from None


async def check(
    path: str, version: int, schemas: dict[str, Any], messages: list[bytes]
) -> str | None:
    """Why the append of ``messages`` to the state stream at ``path`` (registration
    ``version``, its ``schemas``) is refused, naming the event; None when it is not."""
    deadline = _deadline(messages)
    pool = _pool()
    # Waiting for a checker is bounded too: appends queued behind costly checks are a 503
    # (found by reading: the wait had no bound, and every state append of the process whose
    # schemas are not plain queued behind them).
    try:
        async with asyncio.timeout(settings.DS_STATE_CHECK_TIMEOUT_SECS):
            checker = await pool.take()
    except TimeoutError:
        raise CheckUnavailable from None
    key = (path, version)
    try:
        for _ in range(2):  # once more if the child dropped the registration meanwhile
            try:
                await _run(checker.prepare, key, schemas)
            except (ChildTimeout, ChildUnavailable) as exc:
                checker = pool.replace(checker)
                logger.warning("schema checker could not be prepared: %s", exc)
                raise CheckUnavailable from None
            try:
                kind, detail = await _run(checker.judge, key, messages, deadline)
            except ChildTimeout:
                checker = pool.replace(checker)
                metrics.STATE_CHECK_TIMEOUTS.inc()
                logger.warning("schema check of an append to %s overran %.1f s", path, deadline)
                raise CheckTimeout(f"{deadline:.1f}") from None
            except ChildUnavailable as exc:
                checker = pool.replace(checker)
                logger.warning("schema checker died: %s", exc)
                raise CheckUnavailable from None
            if kind != "unknown":
                break
            checker.known.discard(key)
        if kind == "unknown":  # dropped twice in a row: never answer unchecked
            raise CheckUnavailable
        if kind == "error":
            return f"the append could not be checked against its schemas ({detail})"
        return detail
    except BaseException:
        if checker.busy:  # cancelled while its thread waits: that child is not to be reused
            checker = pool.replace(checker)
        raise
    finally:
        pool.give_back(checker)


def _deadline(messages: list[bytes]) -> float:
    """The check's deadline: the setting, and a second per MiB of the messages."""
    size = sum(len(message) for message in messages)
    return float(settings.DS_STATE_CHECK_TIMEOUT_SECS + _SECS_PER_MIB * size / 2**20)


async def _run(function: Any, *args: Any) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_EXECUTOR, function, *args)


class _Checker:
    """One checking process (its ``Child``) and the registrations compiled in it. Used by one
    request at a time; killed, it is replaced by a new object, never used again."""

    def __init__(self) -> None:
        self.child = Child("ds-schema-check", _serve)
        self.known: set[tuple[str, int]] = set()
        self.busy = False  # a round trip in flight (whose thread may outlive a cancellation)

    def prepare(self, key: tuple[str, int], schemas: dict[str, Any]) -> None:
        """Blocking: the process started, and the registration compiled in it."""
        if key not in self.known:
            self._request(("compile", key, schemas), SETUP_SECS)
            self.known.add(key)

    def judge(self, key: tuple[str, int], messages: Any, deadline: float) -> Answer:
        """Blocking: the child's verdict on ``messages``."""
        return self._request(("judge", key, messages), deadline)

    def _request(self, message: tuple[Any, ...], deadline: float) -> Answer:
        self.busy = True
        answer = self.child.request(message, deadline)
        self.busy = False
        return answer

    def kill(self) -> None:
        self.child.kill()


class _Pool:
    def __init__(self) -> None:
        self._idle: asyncio.Queue[_Checker] = asyncio.Queue()
        for _ in range(CHECKERS):
            self._idle.put_nowait(_Checker())

    async def take(self) -> _Checker:
        return await self._idle.get()

    def give_back(self, checker: _Checker) -> None:
        self._idle.put_nowait(checker)

    def replace(self, checker: _Checker) -> _Checker:
        checker.kill()
        return _Checker()


_pools: dict[tuple[int, int], tuple[asyncio.AbstractEventLoop, _Pool]] = {}


def _pool() -> _Pool:
    """The pool of this process and event loop (a child process of uvicorn's, or another
    loop of the same process, gets its own: a queue belongs to one loop)."""
    loop = asyncio.get_running_loop()
    key = (os.getpid(), id(loop))
    found = _pools.get(key)
    if found is None or found[0] is not loop:
        found = _pools[key] = (loop, _Pool())
    return found[1]


def _serve(conn: Connection) -> None:
    """The child: compile registrations and judge appends until the parent goes away."""
    from state.core.schemas import SchemaError, compile_schemas, judge

    compiled: OrderedDict[tuple[str, int], Any] = OrderedDict()

    def handle(request: tuple[Any, ...]) -> Answer:
        kind, key = request[0], request[1]
        if kind == "compile":
            try:
                compiled[key] = compile_schemas(request[2], bounded=False)
            except (SchemaError, RecursionError):  # checked at registration
                compiled[key] = {}
            while len(compiled) > _CACHED_REGISTRATIONS:
                compiled.popitem(last=False)
            return ("compiled", None)
        validators = compiled.get(key)
        if validators is None:
            return ("unknown", None)
        compiled.move_to_end(key)
        if kind == "judge_each":
            return ("answer", [judge(message, validators)[1] for message in request[2]])
        return ("answer", _judge(request[2], validators))

    serve(conn, handle)


def _judge(messages: list[bytes], validators: Any) -> str | None:
    from state.core import InvalidEvent, parse_event
    from state.core.schemas import rejection

    for index, message in enumerate(messages):
        try:
            event = parse_event(json.loads(message))
        except (InvalidEvent, ValueError) as exc:
            return f"event {index}: not a valid state event: {exc}"
        reason = rejection(event, message, validators)
        if reason is not None:
            return f"event {index}: {reason}"
    return None


class HistoryChecker:
    """Judges stored messages against schemas in a process of its own, for a rebuild (a
    registration's runs in a Django thread of the server, where a check holds Python's lock
    as it would on the event loop: a client registering a thrashing pattern over a stream of
    large strings stalled the worker, found by review). Each chunk has the check's deadline;
    past it the process is killed and CheckTimeout raised. Close it when done."""

    def __init__(self, schemas: dict[str, Any]) -> None:
        self._checker = _Checker()
        self._key = ("history", 0)
        try:
            self._checker.prepare(self._key, schemas)
        except (ChildTimeout, ChildUnavailable) as exc:
            raise CheckUnavailable(str(exc)) from None

    def reasons(self, messages: list[bytes]) -> list[str | None]:
        deadline = _deadline(messages)
        try:
            kind, detail = self._checker.child.request(
                ("judge_each", self._key, messages), deadline
            )
        except ChildTimeout:
            metrics.STATE_CHECK_TIMEOUTS.inc()
            raise CheckTimeout(f"{deadline:.1f}") from None
        except ChildUnavailable as exc:
            raise CheckUnavailable(str(exc)) from None
        if kind != "answer":
            raise CheckUnavailable(detail)
        return list(detail)

    def close(self) -> None:
        self._checker.kill()
