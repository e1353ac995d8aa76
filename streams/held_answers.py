"""The bytes of answers this process holds until their clients take them, and what a read may
carry given that.

A catch-up or long-poll answer is built whole (up to DS_READ__MAX_CHUNK_BYTES) and sent in
blocks as its client takes them. A client on a slow link (the write deadline lets one that
takes 64 KiB per DS_SERVER__SEND_TIMEOUT_SECS keep its connection) holds its answer's memory
for as long as that takes, so a few hundred such clients could hold gigabytes. Past
DS_READ__HELD_ANSWERS_BYTES held by the process, reads carry at most ``TIGHT_READ_BYTES``
(always at least one message): clients still get everything, in more requests, and what slow
clients hold stays near the budget (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings

from streams import metrics

# What a read carries while the process holds more than its budget of answers.
TIGHT_READ_BYTES = 64 * 1024

_held = 0
# Bytes reads under way may bring: what each was allowed to read, until it has read.
_reading = 0


@contextmanager
def holding(size: int) -> Iterator[None]:
    """Count ``size`` bytes of an answer as held while it is being sent (0: nothing to do)."""
    global _held
    if not size:
        yield
        return
    _held += size
    metrics.HELD_ANSWER_BYTES.set(_held)
    try:
        yield
    finally:
        _held -= size
        metrics.HELD_ANSWER_BYTES.set(_held)


def read_limit(limit: int) -> int:
    """``limit``, or at most ``TIGHT_READ_BYTES`` while the answers held, and those reads
    under way may bring, exceed the budget."""
    if _held + _reading > settings.DS_READ_HELD_ANSWERS_BYTES:
        return min(limit, TIGHT_READ_BYTES)
    return limit


@contextmanager
def reading(limit: int) -> Iterator[None]:
    """Count a read allowed ``limit`` bytes while it runs: reads that began together were
    each allowed the whole budget (probe 8b: 100 clients that never read their 8 MiB answers
    held 3.1 times it)."""
    global _reading
    _reading += limit
    try:
        yield
    finally:
        _reading -= limit


def held() -> int:
    return _held
