"""Fixtures shared by the Yjs tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.yjs.support import COMPACTION_THRESHOLD


@pytest.fixture(scope="session")
def compacting_servers(start_server: Any) -> tuple[Any, Any]:
    """Two server processes on the test database that compact a document past
    COMPACTION_THRESHOLD bytes of updates: the compaction, provider and multiprocess tests
    share them (each test uses its own documents)."""
    env = {"YJS_COMPACTION_THRESHOLD_BYTES": str(COMPACTION_THRESHOLD)}
    return start_server(env=env, shared=True), start_server(env=env, shared=True)
