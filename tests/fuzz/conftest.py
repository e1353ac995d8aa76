"""The fuzzers' server and their report.

``fuzz_server`` is a real uvicorn process (tests/conftest.py) with small limits, so that the
fuzzers reach the 413 paths and paged reads with small bodies, short long-polls, and Yjs
compaction at a few KiB. At the end of the session the tally of every request the fuzzers made
is printed; ``FUZZ_MIN_REQUESTS`` (``make test-fuzz``) fails the run if fewer fuzz requests
were sent.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

from tests.fuzz.support import TALLY

FUZZ_SERVER_ENV = {
    "DS_LIMITS__MAX_REQUEST_BYTES": str(128 * 1024),
    "DS_LIMITS__MAX_STREAM_BYTES": str(256 * 1024),
    "DS_LIMITS__MAX_APPEND_MESSAGES": "5000",
    "DS_READ__MAX_CHUNK_BYTES": str(32 * 1024),
    "DS_READ__MAX_CHUNK_MESSAGES": "2000",
    "DS_SERVER__LONG_POLL_TIMEOUT_SECS": "1",
    "DS_HTTP__BODY_READ_TIMEOUT_SECS": "3",
    "DATA_UPLOAD_MAX_MEMORY_SIZE": str(128 * 1024),
    "YJS_COMPACTION_THRESHOLD_BYTES": "512",
    "DS_LOG_LEVEL": "WARNING",
}

# Server log lines that mean a bug whatever the client sent.
_FAULT = re.compile(r"Traceback|unhandled error|Exception in ASGI|ERROR", re.IGNORECASE)
# Log records of known, unfixed defects (tests/fuzz/test_known_defects.py reproduces each as an
# xfail): counted and reported, not failed on. Remove an entry when its defect is fixed.
KNOWN_DEFECTS: dict[str, re.Pattern[str]] = {}
# The lines of a traceback that follows a known record.
_TRACEBACK_LINE = re.compile(r"Traceback \(|\s|[\w.]+(Error|Exception)\b|During handling|$")
KNOWN_SEEN: dict[str, int] = {}


_started: list[Any] = []


@pytest.fixture(scope="session")
def fuzz_server(start_server: Any) -> Any:
    server = start_server(env=FUZZ_SERVER_ENV, shared=True)
    _started.append(server)
    return server


@pytest.fixture(autouse=True)
def no_faults_logged() -> Any:
    """After each fuzz test, the fuzz server has logged no traceback or error line (errors the
    clients never see: background work such as Yjs compaction failing on what was accepted)."""
    seen = len(_log_lines())
    yield
    faults = _faults(_log_lines()[seen:])
    assert not faults, "the fuzz server logged errors:\n" + "\n".join(faults[:40])


def _faults(lines: list[str]) -> list[str]:
    """The fault lines of a log, less the records (and their tracebacks) of known defects."""
    faults: list[str] = []
    in_known = False
    for line in lines:
        known = next((name for name, rule in KNOWN_DEFECTS.items() if rule.search(line)), None)
        if known is not None:
            KNOWN_SEEN[known] = KNOWN_SEEN.get(known, 0) + 1
            in_known = True
            continue
        if in_known and _TRACEBACK_LINE.match(line):
            continue
        in_known = False
        if _FAULT.search(line):
            faults.append(line)
    return faults


def _log_lines() -> list[str]:
    if not _started:
        return []
    return _started[0].log_path.read_text(errors="replace").splitlines()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TALLY.fuzz_requests and not TALLY.check_requests:
        return
    terminalreporter.section("fuzz tally")
    for line in TALLY.summary():
        terminalreporter.write_line(line)
    for message in TALLY.server_errors[:10]:
        terminalreporter.write_line(f"5xx: {message}")
    for message in TALLY.partial_writes[:10]:
        terminalreporter.write_line(f"partial write: {message}")
    for name, count in KNOWN_SEEN.items():
        terminalreporter.write_line(f"known defect seen in the server log {count}x: {name}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    wanted = int(os.environ.get("FUZZ_MIN_REQUESTS", "0"))
    if wanted and TALLY.fuzz_requests < wanted:
        print(f"\nFUZZ_MIN_REQUESTS={wanted} but only {TALLY.fuzz_requests} fuzz requests ran")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
