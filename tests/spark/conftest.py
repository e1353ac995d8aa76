"""Fixtures shared by the Spark tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of the shared server, patient enough for 1000-message appends."""
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client
