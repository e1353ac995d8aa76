"""Retention services (PROTOCOL.md 4: retention; docs/gaps.md, Retention): a stream owner's
trim, the retention sweep that enforces retention policies, and the purge that gives the space
back.

A trim answers as soon as the stream's new start is committed (one short transaction under
its row lock); the rows below are deleted afterwards by the purge, in bounded batches that take
no stream lock, here in the background and by every process's periodic sweep. The sweep runs
in every server process and in ``manage.py trim_streams``; processes keep out of each other's
way (trims skip streams locked by someone else, purges are claimed with a lease).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings

from access.grants import Operation, Principal, stream_resource
from streams import metrics
from streams.protocol.offsets import Offset
from streams.store import retention as store
from streams.store.failures import log_failure
from streams.store.types import Retention, StreamMeta, TrimResult

logger = logging.getLogger(__name__)

# Streams looked at per statement of the sweep.
PAGE = 500
# A purger keeps a stream this long before another process may take it over.
PURGE_LEASE_SECS = 60.0

# Progress of a sweep: (what happened, the stream's path, details), for trim_streams.
Progress = Callable[[str, str, str], None]

_purger: asyncio.Task[None] | None = None
_purge_again = False


async def trim_stream(
    *, path: str, principal: Principal, before: Offset | None, resource: str | None = None
) -> TrimResult:
    """Drop everything before ``before`` (None: everything so far), for the stream's owner
    (``manage``). Offsets of what stays never change; reads of earlier offsets answer 410."""
    principal.require(resource or stream_resource(path), Operation.MANAGE)
    result = await store.trim(path, before)
    if result.trimmed:
        schedule_purge()
    return result


async def retention_of(meta: StreamMeta) -> Retention:
    """The retention policy that applies to a stream: its own, else the server-wide default
    (unless the stream is exempt from it)."""
    if meta.retention:
        return meta.retention
    default = Retention(settings.DS_RETENTION_MAX_AGE_SECS, settings.DS_RETENTION_MAX_BYTES)
    if default and await store.default_applies(meta.id, meta.path):
        return default
    return Retention()


@dataclass
class SweepReport:
    streams: int = 0
    trimmed: list[str] = field(default_factory=list)
    purged_rows: int = 0


async def enforce_retention(
    progress: Progress | None = None, only: set[str] | None = None
) -> SweepReport:
    """One pass of the retention sweep: every stream under a retention policy (of ``only``,
    when given) is marked in its time index and trimmed to what its policy keeps; then
    trimmed rows are purged."""
    report = SweepReport()
    after = 0
    while True:
        page = await store.retention_page(
            after,
            PAGE,
            default_age=settings.DS_RETENTION_MAX_AGE_SECS,
            default_bytes=settings.DS_RETENTION_MAX_BYTES,
            mark_interval=max(settings.DS_RETENTION_SWEEP_INTERVAL_SECS, 1.0),
        )
        for candidate in page:
            if only is not None and candidate.path not in only:
                continue
            report.streams += 1
            if candidate.due and await store.retention_trim(candidate.stream_id, candidate.target):
                report.trimmed.append(candidate.path)
                if progress is not None:
                    progress("trimmed", candidate.path, f"{candidate.start} -> {candidate.target}")
        if len(page) < PAGE:
            break
        after = page[-1].stream_id
    if report.trimmed:
        metrics.RETENTION_TRIMS.inc(len(report.trimmed))
    report.purged_rows = await purge(progress)
    return report


async def purge(progress: Progress | None = None) -> int:
    """Delete trimmed rows of every stream waiting for it, batch by batch; returns the rows
    deleted."""
    total = 0
    batch = settings.DS_RETENTION_PURGE_BATCH_ROWS
    while (claim := await store.purge_claim(PURGE_LEASE_SECS)) is not None:
        deleted = 0
        position: int | None = None
        while True:
            position, rows = await store.purge_step(claim, position, batch)
            deleted += rows
            if position is None:
                break
        total += deleted
        metrics.PURGED_MESSAGES.inc(deleted)
        if progress is not None and deleted:
            progress("purged", claim.path, f"{deleted} messages")
    return total


def schedule_purge() -> None:
    """Purge in the background of this process soon (after a trim): one purger at a time,
    which runs again if asked while it works."""
    global _purger, _purge_again
    if _purger is not None and not _purger.done():
        _purge_again = True
        return
    _purger = asyncio.get_running_loop().create_task(_purge_soon(), name="ds-purge")


async def _purge_soon() -> None:
    global _purge_again
    try:
        while True:
            _purge_again = False
            await purge()
            if not _purge_again:
                return
    except Exception as exc:  # noqa: BLE001 - the periodic sweep retries
        log_failure(logger, "purging trimmed messages", exc)


async def sweep() -> None:
    """The periodic job (streams.lifecycle)."""
    report = await enforce_retention()
    if report.trimmed or report.purged_rows:
        logger.info(
            "retention: trimmed %d streams, purged %d messages",
            len(report.trimmed),
            report.purged_rows,
        )
