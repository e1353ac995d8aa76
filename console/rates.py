"""Appends per second and live readers over the last minutes, for the console's overview.

The figures are the server's own metrics (``streams.metrics``), summed over every worker as
``/metrics`` sums them. Every worker samples them every ``SAMPLE_SECS`` and keeps the last
``HISTORY_SECS``: each sample is of the whole server, so whichever worker answers the overview
has the same history. A sample reads the workers' metric snapshots (a few small files), in a
thread; with metrics off there is nothing to sample and nothing runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

from django.conf import settings

from streams import metrics

logger = logging.getLogger(__name__)

SAMPLE_SECS = 2.0
HISTORY_SECS = 5 * 60
# "Appends per second now" is over this many intervals (10 s), so that the other workers'
# snapshots, up to a second old, do not make it jump.
RECENT_INTERVALS = 5
APPENDS = "ds_appends_total"
LIVE_READERS = "ds_live_readers"
# The outcome of an append that stored data (streams.store.group_commit).
STORED = ("outcome", "appended")


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # Unix seconds
    appends: float  # appends that stored data, ever, over every worker
    live_readers: float


@dataclass(frozen=True, slots=True)
class Rates:
    appends_per_second: float | None
    live_readers: int | None
    # (Unix seconds, appends per second in the interval ending then), oldest first
    history: list[tuple[float, float]]


_samples: deque[Sample] = deque(maxlen=int(HISTORY_SECS / SAMPLE_SECS) + 1)
_task: asyncio.Task[None] | None = None


def sample() -> Sample:
    """The server's figures now (this worker's own written first, so they are exact; the
    others' are at most ``metrics.FLUSH_SECS`` old)."""
    metrics.flush()
    summed = metrics.totals(frozenset({APPENDS, LIVE_READERS}))
    appends = sum(v for (name, labels), v in summed.items() if name == APPENDS and STORED in labels)
    readers = sum(v for (name, _), v in summed.items() if name == LIVE_READERS)
    return Sample(time.time(), appends, readers)


def record(new: Sample) -> None:
    _samples.append(new)


def current() -> Rates:
    """Appends per second over the last seconds, live readers now, and the history."""
    if not settings.DS_METRICS_ENABLED:
        return Rates(None, None, [])
    samples = list(_samples)
    history = [(later.at, _rate(earlier, later)) for earlier, later in itertools.pairwise(samples)]
    recent = samples[-1 - RECENT_INTERVALS :]
    latest = _rate(recent[0], recent[-1]) if len(recent) > 1 else None
    readers = int(samples[-1].live_readers) if samples else int(sample().live_readers)
    return Rates(latest, readers, history)


def _rate(earlier: Sample, later: Sample) -> float:
    elapsed = later.at - earlier.at
    # A counter that went down: the server restarted with fresh metrics. No rate for that gap.
    if elapsed <= 0 or later.appends < earlier.appends:
        return 0.0
    return (later.appends - earlier.appends) / elapsed


def ensure_started() -> None:
    global _task
    if settings.DS_METRICS_ENABLED and (_task is None or _task.done()):
        _task = asyncio.get_running_loop().create_task(_sample_forever(), name="console-rates")


def stop() -> None:
    if _task is not None:
        _task.cancel()


async def _sample_forever() -> None:
    while True:
        try:
            record(await asyncio.to_thread(sample))
        except Exception:
            logger.exception("sampling the metrics for the console failed")
        await asyncio.sleep(SAMPLE_SECS)
