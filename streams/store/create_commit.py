"""Group commit of stream creations.

Every create is recorded in the ``__registry__`` stream in its own transaction
(``state/sql``), so concurrent creates queue on the registry's row lock, each holding it
through its commit's WAL flush: 300 concurrent creates took 300 flushes one after another. So,
as with appends (``group_commit``): at most ``MAX_TRANSACTIONS`` create transactions are in
flight per process, and creates arriving while they are busy wait and go together in the next
one (one lock hold, one flush), each still judged on its own. A lone create never waits: it
is written in its caller's task (as a lone append is: ``group_commit``). If the shared
transaction fails, each create is written alone, so an error fails only its own.
"""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings

from streams.errors import ProtocolError, ServiceUnavailable
from streams.store.failures import refusal_for
from streams.store.types import CreateRequest, CreateResult
from streams.store.writes import create_stream, create_streams

logger = logging.getLogger(__name__)

MAX_TRANSACTIONS = 2
MAX_CREATES = 128

Pending = tuple[CreateRequest, "asyncio.Future[CreateResult]"]

_pending: list[Pending] = []
_in_flight = 0
_writers: set[asyncio.Task[None]] = set()


async def create(request: CreateRequest) -> CreateResult:
    """Create through the queue; returns after commit or raises the request's error."""
    future: asyncio.Future[CreateResult] = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    _pending.append((request, future))
    if len(_pending) == 1 and (batch := _take_batch()) is not None:
        await _write(batch)  # alone: written here
        return future.result()
    _dispatch()
    return await asyncio.shield(future)


def _dispatch() -> None:
    while (batch := _take_batch()) is not None:
        writer = asyncio.get_running_loop().create_task(_write(batch))
        _writers.add(writer)
        writer.add_done_callback(_writers.discard)


def _take_batch() -> list[Pending] | None:
    """The next transaction's creates, its slot taken; None when none wait or no slot is
    free."""
    global _in_flight
    if not _pending or _in_flight >= MAX_TRANSACTIONS:
        return None
    batch = _pending[:MAX_CREATES]
    del _pending[:MAX_CREATES]
    _in_flight += 1
    return batch


async def _write(batch: list[Pending]) -> None:
    global _in_flight
    try:
        requests = [request for request, _ in batch]
        results = await _results(requests)
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
    finally:
        _in_flight -= 1
        _dispatch()


async def _results(requests: list[CreateRequest]) -> list[CreateResult | ProtocolError]:
    limit = settings.DS_MAX_STREAM_BYTES
    if len(requests) > 1:
        try:
            return await create_streams(requests, max_stream_bytes=limit)
        except ServiceUnavailable as unreachable:
            return [unreachable] * len(requests)
        except Exception:  # noqa: BLE001 - some create failed: each is judged alone now
            logger.warning("a transaction of %d creates failed; creating each alone", len(requests))
    return [await _alone(request) for request in requests]


async def _alone(request: CreateRequest) -> CreateResult | ProtocolError:
    try:
        return await create_stream(request, max_stream_bytes=settings.DS_MAX_STREAM_BYTES)
    except ProtocolError as error:
        return error
    except Exception as exc:
        refusal = refusal_for(exc)
        if refusal is None:
            logger.error("create of %r failed", request.path, exc_info=exc)
            return ProtocolError("internal server error")
        return refusal
