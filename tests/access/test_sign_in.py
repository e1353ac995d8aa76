"""Sign-ins to the admin, throttled per process (probe 10h): an address that keeps failing is
refused for a while, and password checks run a few at a time, so guessing cannot take the
database connections every other page needs."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx

from tests.conftest import ADMIN_PASSWORD, create_superuser


def _superuser(database_url: str) -> str:
    username = f"signin{time.time_ns()}"
    create_superuser(database_url, username)
    return username


def _form(
    client: httpx.Client | httpx.AsyncClient, token: str, username: str, password: str
) -> Any:
    return client.post(
        "/admin/login/?next=/admin/",
        data={"csrfmiddlewaretoken": token, "username": username, "password": password},
        headers={"Referer": f"{client.base_url}/admin/login/"},
    )


def _token(page: httpx.Response) -> str:
    found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


def test_an_address_that_keeps_failing_is_refused_for_a_while(
    start_server: Any, database_url: str
) -> None:
    server = start_server(env={"DS_AUTH__SIGN_IN_FAILURES": "3"})
    username = _superuser(database_url)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        token = _token(client.get("/admin/login/"))
        for _ in range(3):
            assert _form(client, token, username, "wrong guess").status_code == 200
        barred = _form(client, token, username, ADMIN_PASSWORD)
        assert barred.status_code == 429, barred.text[:200]
        assert 0 < int(barred.headers["Retry-After"]) <= 300
        assert "this address" in barred.text


def test_password_checks_run_a_few_at_a_time(start_server: Any, database_url: str) -> None:
    server = start_server(env={"DS_AUTH__SIGN_INS_AT_ONCE": "1"})
    username = _superuser(database_url)

    async def guess_together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            token = _token(await client.get("/admin/login/"))
            return await asyncio.gather(*(_form(client, token, username, "x") for _ in range(6)))

    statuses = sorted(response.status_code for response in asyncio.run(guess_together()))
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
    with httpx.Client(base_url=server.base_url, timeout=30, follow_redirects=True) as client:
        signed_in = _form(client, _token(client.get("/admin/login/")), username, ADMIN_PASSWORD)
        assert signed_in.status_code == 200 and "Log out" in signed_in.text
