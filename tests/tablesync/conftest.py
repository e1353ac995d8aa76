"""The admin, logged in as a superuser, for the table sync tests."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess, command_env, manage

PASSWORD = "correct-horse-battery-staple"


@pytest.fixture(scope="module")
def admin_client(server: ServerProcess, database_url: str) -> Iterator[httpx.Client]:
    username = f"tsadmin{time.time_ns()}"
    created = manage(
        database_url, "createsuperuser", "--noinput", "--username", username,
        "--email", "admin@example.com",
        env=command_env(database_url, DJANGO_SUPERUSER_PASSWORD=PASSWORD),
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    with httpx.Client(base_url=server.base_url, timeout=30, follow_redirects=True) as client:
        login_page = client.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login_page.text)
        assert token is not None
        response = client.post(
            "/admin/login/?next=/admin/",
            data={"csrfmiddlewaretoken": token.group(1), "username": username,
                  "password": PASSWORD},
            headers={"Referer": f"{server.base_url}/admin/login/"},
        )  # fmt: skip
        assert response.status_code == 200 and "Log out" in response.text
        yield client
