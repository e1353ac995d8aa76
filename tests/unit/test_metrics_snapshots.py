"""A worker's metric snapshots (streams.metrics): written whole, whoever writes them."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from streams import metrics


def test_concurrent_flushes_of_one_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The periodic flush, a /metrics scrape and the console's sampler each flush from a worker
    thread of their own. Two at once raced on the one temporary file: one renamed it, the other
    failed with FileNotFoundError (seen in the fuzz server's log)."""
    monkeypatch.setenv("DS_METRICS__DIR", str(tmp_path))
    metrics.APPENDS.labels("appended").inc()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def flush_repeatedly() -> None:
        start.wait()
        try:
            for _ in range(300):
                metrics.flush()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=flush_repeatedly) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    snapshot = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
    assert any(family[0] == "ds_appends" for family in snapshot)
    assert list(tmp_path.glob(".*.tmp")) == []
