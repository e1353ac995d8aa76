"""The console over HTTP (no browser): who may see it, what bad input gets, what its pages
escape, the signed URLs its pages use, and its figures. A server of its own requires API keys,
as in production."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.access.support import bearer, create_key
from tests.browser.support import PASSWORD, create_user
from tests.conftest import ServerProcess, manage


@pytest.fixture(scope="session")
def keys_server(start_server: Any) -> ServerProcess:
    """A server that requires API keys, as in production: the console's pages must follow
    streams through signed read URLs."""
    return start_server(env={"DS_AUTH__MODE": "keys"}, shared=True)


@pytest.fixture(scope="session")
def ops_key(keys_server: ServerProcess, database_url: str) -> str:
    return create_key(database_url, f"console-tests-{time.time_ns()}", ":read,append,manage")


@pytest.fixture
def api(keys_server: ServerProcess, ops_key: str) -> Iterator[httpx.Client]:
    """A client of the protocol and REST API, with a key that may do everything."""
    with httpx.Client(base_url=keys_server.base_url, headers=bearer(ops_key), timeout=30) as c:
        yield c


def staff_user(database_url: str, username: str, *permissions: str) -> None:
    """A staff user (not a superuser) with these permissions ("app.codename")."""
    create_user(database_url, username, superuser=False)
    script = (
        "from django.contrib.auth import get_user_model;"
        "from django.contrib.auth.models import Permission;"
        f"u = get_user_model().objects.get(username={username!r}); u.is_staff = True; u.save();"
        f"[u.user_permissions.add(Permission.objects.get(content_type__app_label=p.split('.')[0],"
        f" codename=p.split('.')[1])) for p in {list(permissions)!r}]"
    )
    result = manage(database_url, "shell", "-c", script)
    assert result.returncode == 0, result.stderr


@contextlib.contextmanager
def logged_in(server: ServerProcess, username: str) -> Iterator[httpx.Client]:
    """A client with the user's session, logged in through the admin's form."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        page = client.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert token is not None
        client.post(
            "/admin/login/",
            data={
                "csrfmiddlewaretoken": token.group(1),
                "username": username,
                "password": PASSWORD,
            },
            headers={"Referer": f"{server.base_url}/admin/login/"},
        )
        assert "sessionid" in client.cookies, f"{username} could not log in"
        yield client


@pytest.fixture(scope="module")
def superuser(keys_server: ServerProcess, database_url: str) -> Iterator[httpx.Client]:
    username = f"super{time.time_ns()}"
    create_user(database_url, username)
    with logged_in(keys_server, username) as client:
        yield client


def csrf(client: httpx.Client, page_url: str) -> dict[str, str]:
    """The CSRF token of a page's form, and the Referer a POST from it carries."""
    page = client.get(page_url)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None, page.text[:500]
    return {"csrfmiddlewaretoken": token.group(1)}


def referer(client: httpx.Client) -> dict[str, str]:
    return {"Referer": f"{client.base_url}/console/", "Accept": "application/json"}
