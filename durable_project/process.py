"""What a server process sets up before Django loads (``durable_project.asgi``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
from multiprocessing import parent_process
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured


def share_metrics_directory() -> None:
    """The directory where the workers of this server leave their metrics (streams.metrics):
    one per server start, named after the server (the uvicorn supervisor when there are
    workers) and its start time, so a reused pid is another server. ``DS_METRICS__DIR`` set by
    the operator wins; ``DS_METRICS__ENABLED=false`` turns metrics off."""
    chosen = os.environ.get("DS_METRICS__DIR")
    if chosen:
        # Checked here, not at the first flush: a directory that cannot be written made every
        # scrape a 500 and every flush a traceback (probe 10f).
        try:
            Path(chosen).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ImproperlyConfigured(f"DS_METRICS__DIR {chosen!r}: {exc.strerror}") from None
        if not os.access(chosen, os.W_OK | os.X_OK):
            raise ImproperlyConfigured(f"DS_METRICS__DIR {chosen!r} is not writable")
        return
    if os.environ.get("DS_METRICS__ENABLED", "true").lower() in ("false", "0", "no", "off"):
        return
    parent = parent_process()
    owner = parent.pid if parent is not None and parent.pid is not None else os.getpid()
    directory = (
        Path(tempfile.gettempdir()) / "durable-streams-metrics" / f"{owner}-{_started(owner)}"
    )
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["DS_METRICS__DIR"] = str(directory)


def _started(pid: int) -> str:
    """The process's start time in clock ticks (Linux /proc), or 0."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap, and freed memory is given back to the system
# only beyond twice this much at the heap's top (DS_SERVER__MALLOC_MMAP_THRESHOLD_BYTES; 0:
# glibc's defaults).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024


def tune_malloc() -> bool:
    """Keep large buffers in the heap, reused, instead of mapped afresh for each.

    glibc maps every allocation over its threshold (128 KiB at first, raised by what is freed,
    up to 32 MiB) on its own, and gives it back when freed: a large read or append allocates
    megabytes (libpq's result, the blocks a body is sent in, a request's body) whose pages are
    all faulted in again, zeroed by the kernel, on every request. Measured on a catch-up read of
    80 x 64 KiB: 70% of the server's CPU was copying into fresh pages (page faults, clearing);
    with the heap keeping them, 20 -> 13-15 ms of CPU per read (docs/benchmarks.md). The cost
    is memory kept: up to twice the threshold, free, at the top of a worker's heap. Nothing is
    done where there is no glibc. Returns whether it was done."""
    raw = os.environ.get("DS_SERVER__MALLOC_MMAP_THRESHOLD_BYTES", MMAP_THRESHOLD_BYTES) or 0
    try:
        threshold = int(raw)
    except ValueError:
        raise ImproperlyConfigured(
            f"DS_SERVER__MALLOC_MMAP_THRESHOLD_BYTES must be an integer, not {raw!r}"
        ) from None
    if threshold <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold) and mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
