"""The admin, logged in as a superuser, for the table sync tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess, admin_session


@pytest.fixture(scope="module")
def admin_client(server: ServerProcess, database_url: str) -> Iterator[httpx.Client]:
    with admin_session(server.base_url, database_url, f"tsadmin{time.time_ns()}") as client:
        yield client
