"""pycrdt's work on clients' updates, in a process of its own, under a deadline.

Yrs (through pycrdt) holds Python's global lock for the whole of each call, and its calls take
time that grows with the bytes they are given: integrating a 54 MB update of map entries held
the lock 4.9 s in one call, and building a copy of a 45 MB document of distinct keys, which
every process does when it first checks a POST to it (and again after a refused one), about as
long. Run in a thread of the server, such a call stopped every request of the worker, and past
5 s uvicorn killed it, cutting every connection (found by measuring; docs/reliability.md). So
the work is done by a child process (``Engine``, a ``durable_project.children.Child``): the
event loop only waits for its answer.

* An ``Engine`` is one child, used by one caller at a time. It keeps the Docs it builds (the
  copies of documents ``yjs.replicas`` checks POSTs against), one per document, under the key
  of the build that made it (a new build replaces it: a review saw copies replaced by new ones
  pile up, +110 MB each), the least recently used dropped past ``YJS_CHECKED_DOCUMENTS`` or
  ``KEPT_BYTES`` of updates in all; a Doc it no longer has is ``Unknown`` to the caller, who
  builds it again.
* Each request has a deadline: ``YJS_CHECK_TIMEOUT_SECS`` plus ``YJS_CHECK_SECS_PER_MIB`` (a
  second) per MiB it carries.
  Past it the child is killed (its Docs with it: their keys are unknown to the next one) and
  ``EngineTimeout`` raised; a new child starts with the next request. A child that dies, or one
  busy with others' requests for longer than a deadline, raises ``EngineUnavailable``.
* ``replicas_engine()`` keeps the copies ``yjs.replicas`` checks POSTs against, and
  ``checks_engine()`` checks POST bodies, for the event loop (through threads of their own; a
  body past its deadline kills only the second); ``blocking_engine()`` serves threads
  (compaction, the admin's and console's previews), each request waiting for the previous one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from django.conf import settings

from durable_project.children import Answer, Child, ChildTimeout, ChildUnavailable, serve

# Bytes of updates the Docs a child keeps may hold in all (a Doc takes about 20 times its
# updates' size in memory).
KEPT_BYTES = 32 * 1024**2
# The blocking pipe round trips of the event loop's engine run here, not in the loop's
# default executor (shared with other work that could delay them past their deadline).
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="ds-yjs")
_keys = itertools.count(1)


class EngineTimeout(Exception):
    """The request overran its deadline (seconds, the message); the child was killed."""


class EngineUnavailable(Exception):
    """The child could not be started, or died."""


class Unknown(Exception):
    """The engine no longer has that Doc (dropped, or the child was replaced): build it."""


class Refused(Exception):
    """pycrdt refused the updates (its error, the message)."""


def new_key() -> int:
    """A key for a Doc to be built: unique in this process."""
    return next(_keys)


class Engine:
    def __init__(self, name: str) -> None:
        self._child = Child(f"ds-yjs-{name}", _serve, settings.YJS_CHECKED_DOCUMENTS)
        self._lock = threading.Lock()

    # -- requests (blocking; Refused, Unknown, EngineTimeout, EngineUnavailable) ---------------

    def build(self, path: str, key: int, snapshot: bytes | None, messages: list[bytes]) -> bool:
        """The Doc of document ``path``, built of a snapshot and stored messages (lib0-framed
        updates) and kept as ``key`` in place of any earlier one; False (nothing kept) when
        they cannot be integrated."""
        size = len(snapshot or b"") + sum(map(len, messages))
        return bool(self._call(("build", path, key, snapshot, messages), size))

    def extend(self, path: str, key: int, messages: list[bytes]) -> bool:
        """Stored messages applied to the Doc ``key`` of ``path``; False (the Doc dropped) when
        they cannot be integrated."""
        return bool(self._call(("extend", path, key, messages), sum(map(len, messages))))

    def apply(self, path: str, key: int, updates: list[bytes]) -> None:
        """A POST's updates applied to the Doc ``key`` of ``path``; Refused (the Doc dropped: it
        may be partly changed) when Yrs cannot integrate them."""
        self._call(("apply", path, key, updates), sum(map(len, updates)))

    def check_updates(self, updates: list[bytes]) -> None:
        """``yjs.updates.check_updates``: Refused with its reason."""
        self._call(("check_updates", updates), sum(map(len, updates)))

    def snapshot(self, updates: list[bytes]) -> bytes:
        """``yjs.updates.snapshot_of``: Refused when pycrdt cannot merge them."""
        snapshot: bytes = self._call(("snapshot", updates), sum(map(len, updates)))
        return snapshot

    def describe(self, updates: list[bytes]) -> dict[str, str]:
        """``yjs.preview.describe`` of their snapshot: Refused when pycrdt cannot merge them."""
        content: dict[str, str] = self._call(("describe", updates), sum(map(len, updates)))
        return content

    # -- the child -------------------------------------------------------------------------

    def _call(self, request: tuple[Any, ...], size: int) -> Any:
        deadline = settings.YJS_CHECK_TIMEOUT_SECS + settings.YJS_CHECK_SECS_PER_MIB * size / 2**20
        # Waiting for others' requests is bounded too: a queue behind slow requests is a 503.
        if not self._lock.acquire(timeout=settings.YJS_CHECK_TIMEOUT_SECS):
            raise EngineUnavailable(f"busy for {settings.YJS_CHECK_TIMEOUT_SECS} s")
        try:
            kind, detail = self._child.request(request, deadline)
        except ChildTimeout as exc:
            raise EngineTimeout(str(exc)) from None
        except ChildUnavailable as exc:
            raise EngineUnavailable(str(exc)) from None
        finally:
            self._lock.release()
        if kind == "ok":
            return detail
        if kind == "unknown":
            raise Unknown
        if kind == "refused":
            raise Refused(detail)
        raise EngineUnavailable(detail)  # "error": a defect in the child, which goes on


async def run(engine: Engine, method: str, *args: Any) -> Any:
    """``engine.<method>(*args)`` from the event loop, in a thread of the engines' own."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_EXECUTOR, getattr(engine, method), *args)


_engines: dict[str, Engine] = {}
_made = threading.Lock()


def _engine(name: str) -> Engine:
    with _made:
        if name not in _engines:
            _engines[name] = Engine(name)
        return _engines[name]


def replicas_engine() -> Engine:
    return _engine("replicas")


def checks_engine() -> Engine:
    return _engine("checks")


def blocking_engine() -> Engine:
    return _engine("compaction")


def _serve(conn: Connection, most: int) -> None:
    """The child: answer requests until the parent goes away."""
    from pycrdt import Doc

    from streams.errors import BadRequest
    from yjs.preview import describe
    from yjs.updates import (
        UnmergeableUpdates,
        apply_updates,
        check_updates,
        integrated,
        snapshot_of,
    )

    # document -> (key of the build that made it, Doc, bytes of updates)
    docs: OrderedDict[str, tuple[int, Any, int]] = OrderedDict()
    kept = 0

    def keep(path: str, key: int, doc: Any, size: int) -> None:
        nonlocal kept
        take(path)
        docs[path] = (key, doc, size)
        kept += size
        while len(docs) > most or (kept > KEPT_BYTES and len(docs) > 1):
            kept -= docs.popitem(last=False)[1][2]

    def take(path: str) -> tuple[int, Any, int]:
        nonlocal kept
        found = docs.pop(path, (0, None, 0))
        kept -= found[2]
        return found

    def handle(request: tuple[Any, ...]) -> Answer:
        kind = request[0]
        if kind == "build":
            _, path, key, snapshot, messages = request
            take(path)  # the earlier copy goes whatever becomes of this one
            doc: Any = Doc()
            built = integrated(doc, snapshot, messages)
            if built:
                keep(path, key, doc, len(snapshot or b"") + sum(map(len, messages)))
            return ("ok", built)
        if kind in ("extend", "apply"):
            # Taken out while it changes: kept again only if the updates went in whole.
            _, path, key, payload = request
            held, doc, size = take(path)
            size += sum(map(len, payload))
            if doc is None or held != key:
                if doc is not None:  # another build's: not this caller's to change
                    keep(path, held, doc, size - sum(map(len, payload)))
                return ("unknown", None)
            if kind == "extend":
                extended = integrated(doc, None, payload)
                if extended:
                    keep(path, key, doc, size)
                return ("ok", extended)
            try:
                apply_updates(doc, payload)
            except UnmergeableUpdates as exc:
                return ("refused", str(exc))
            keep(path, key, doc, size)
            return ("ok", None)
        if kind == "check_updates":
            try:
                check_updates(request[1])
            except BadRequest as exc:
                return ("refused", exc.message)
            return ("ok", None)
        if kind in ("snapshot", "describe"):
            try:
                merged = snapshot_of(request[1])
            except UnmergeableUpdates as exc:
                return ("refused", str(exc))
            return ("ok", merged if kind == "snapshot" else describe(merged))
        return ("error", f"unknown request {kind!r}")

    serve(conn, handle)
