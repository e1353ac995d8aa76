"""What a server process sets up before Django loads (``durable_project.asgi``)."""

from __future__ import annotations

import os
import tempfile
from multiprocessing import parent_process
from pathlib import Path


def share_metrics_directory() -> None:
    """The directory where the workers of this server leave their metrics (streams.metrics):
    one per server start, named after the server (the uvicorn supervisor when there are
    workers) and its start time, so a reused pid is another server. ``DS_METRICS__DIR`` set by
    the operator wins; ``DS_METRICS__ENABLED=false`` turns metrics off."""
    if os.environ.get("DS_METRICS__DIR"):
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
