"""The official Yjs provider (npm @durable-streams/y-durable-streams with yjs) against our
server, driven by tests/js/yjs/providers.mjs (YJS-PROTOCOL.md 5, 8, 9)."""

from __future__ import annotations

import base64
import re
from typing import Any

import httpx
import psycopg
import pytest
from pycrdt import Doc, Text

from tests.conftest import JS_DIR, run_node
from tests.yjs.support import compaction_counts, read_frames

SCRIPT = JS_DIR / "yjs" / "providers.mjs"


@pytest.fixture(scope="module")
def yjs_server(compacting_servers: tuple[Any, Any]) -> Any:
    return compacting_servers[0]


def run_providers(scenario: str, *base_urls: str) -> dict[str, Any]:
    return run_node(SCRIPT, scenario, *base_urls, timeout=120)


def tokens(text: str) -> set[str]:
    return set(re.findall(r"[ABC](?:pre|bulk|post|three)\d+|<[ABC]\d+>", text))


def check_report(report: dict[str, Any], base_url: str) -> None:
    # Convergence before and after compaction, and with a third client.
    for name in ("A", "B"):
        for r in range(3):
            assert f"{name}pre{r}" in report["before"]
            assert f"{name}post{r}" in report["after"]
    for name in ("A", "B", "C"):
        assert f"{name}three1" in report["final"]
    assert tokens(report["before"]) <= tokens(report["after"]) <= tokens(report["final"])
    # Discovery: no snapshot at first, one after the threshold was crossed.
    assert report["locationBefore"].endswith("?offset=-1")
    assert report["locationAfter"].endswith("_snapshot")
    # The late joiner loaded the snapshot (YJS-PROTOCOL.md 9.2), then read updates from its
    # Stream-Next-Offset.
    snapshot_loads = [r for r in report["joinerRequests"] if "_snapshot" in r]
    assert snapshot_loads and snapshot_loads[-1].endswith(" 200"), report["joinerRequests"]
    # It continued from the snapshot's Stream-Next-Offset: the token's last part plus one.
    token = re.search(r"offset=(\d+)_(\d+)_snapshot", snapshot_loads[-1])
    assert token is not None
    continue_at = f"{token.group(1)}_{int(token.group(2)) + 1:016d}"
    assert any(f"offset={continue_at}" in r for r in report["joinerRequests"])
    # Awareness from A reached B.
    assert report["awarenessSeenByB"] == {"name": "Ada", "cursor": 42}
    assert report["errors"] == []
    check_snapshot_content(report, base_url)


def check_snapshot_content(report: dict[str, Any], base_url: str) -> None:
    """The snapshot, loaded in JavaScript yjs, holds exactly the updates stored before its
    Stream-Next-Offset; Python (pycrdt) reads the same bytes the same way."""
    with httpx.Client(timeout=30) as client:
        history = client.get(f"{base_url}/docs/{report['docId']}", params={"offset": "-1"})
    assert history.status_code == 200
    covered = int(report["snapshotNextOffset"].split("_")[1])

    from_updates = Doc()
    text = from_updates.get("text", type=Text)
    for update in read_frames(history.content[:covered]):
        from_updates.apply_update(update)
    from_snapshot = Doc()
    snapshot_text = from_snapshot.get("text", type=Text)
    from_snapshot.apply_update(base64.b64decode(report["snapshotBase64"]))
    assert str(snapshot_text) == str(text) == report["snapshotText"]
    assert report["snapshotText"]


@pytest.mark.slow
def test_providers_converge_before_and_after_compaction(yjs_server: Any) -> None:
    """Two providers editing concurrently converge before and after a compaction; a third
    joining after it loads the snapshot and converges; awareness reaches the others."""
    base_url = f"{yjs_server.base_url}/v1/yjs/tests"
    check_report(run_providers("one-server", base_url), base_url)


@pytest.mark.slow
def test_providers_on_two_server_processes(
    compacting_servers: tuple[Any, Any], pg: psycopg.Connection[Any]
) -> None:
    """Client A on one process, client B on another, one database: edits through one reach
    the other (the same checks as with one server)."""
    first, second = compacting_servers
    base_a = f"{first.base_url}/v1/yjs/tests"
    base_b = f"{second.base_url}/v1/yjs/tests"
    report = run_providers("two-servers", base_a, base_b)
    check_report(report, base_a)
    compactions, snapshots = compaction_counts(pg, "tests", report["docId"])
    assert compactions >= 1 and snapshots == 1  # old snapshots are deleted after each
