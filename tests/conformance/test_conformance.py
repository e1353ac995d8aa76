"""The official conformance suite (npm @durable-streams/server-conformance-tests) against the
production server command, as `make test` starts it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import JS_DIR

# Every test of the suite, the opt-in subscription group (PROTOCOL.md 6, 7) included.
EXPECTED_TESTS = 338


@pytest.mark.slow
def test_official_conformance_suite(server: Any, tmp_path: Path) -> None:
    report = tmp_path / "conformance.json"
    vitest = JS_DIR / "node_modules" / ".bin" / "vitest"
    argv = [
        str(vitest), "run", "--root", str(JS_DIR), "--no-coverage",
        "--reporter=dot", "--reporter=json", f"--outputFile.json={report}",
        "conformance.test.mjs",
    ]  # fmt: skip
    result = subprocess.run(
        argv,
        env={**os.environ, "CONFORMANCE_TEST_URL": server.base_url, "DS_SUBSCRIPTIONS": "true"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert report.exists(), f"vitest wrote no report\n{output}"
    summary = json.loads(report.read_text())
    failures = [
        t["fullName"]
        for file in summary["testResults"]
        for t in file["assertionResults"]
        if t["status"] == "failed"
    ]
    assert failures == [], f"{len(failures)} conformance tests failed:\n" + "\n".join(failures)
    assert summary["numPassedTests"] == EXPECTED_TESTS, result.stdout[-3000:]
