"""What a deployment behind a CDN or a reverse proxy relies on, with access control on (found by
a probe aimed at what an internet-facing deployment gets wrong): caches never share one key's
reads, the REST API answers browsers' preflights, log lines cannot be forged through a path,
signed URLs name only valid streams, and the admin's cookies can be kept to HTTPS."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from tests.access.support import bearer, create_key
from tests.conftest import ServerProcess

TEXT = {"Content-Type": "text/plain"}
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(start_server: Any) -> ServerProcess:
    # Two messages to a chunk: a read from the start does not reach the tail of three.
    env = {
        "DS_AUTH__MODE": "keys",
        "DS_READ__MAX_CHUNK_MESSAGES": "2",
        "DS_HTTP__CORS_ORIGINS": ORIGIN,
        "DJANGO_SECURE_COOKIES": "true",
        "DJANGO_HSTS_SECONDS": "600",
        "DJANGO_PROXY_SSL_HEADER": "X-Forwarded-Proto",
        "DS_LOG_LEVEL": "INFO",  # request lines
    }
    return start_server(env=env)


@pytest.fixture(scope="module")
def tenant(database_url: str, server: ServerProcess) -> dict[str, str]:
    return bearer(create_key(database_url, "proxy-tenant", "stream/tenant-a/:read,append,manage"))


def _stream_of_three(server: ServerProcess, key: dict[str, str]) -> str:
    path = f"tenant-a/{time.time_ns()}"
    assert httpx.put(server.stream_url(path), headers=TEXT | key).status_code == 201
    for body in ("one", "two", "three"):
        answer = httpx.post(server.stream_url(path), headers=TEXT | key, content=body)
        assert answer.status_code == 204, answer.text
    return path


def test_historical_chunks_read_with_credentials_are_private(
    server: ServerProcess, tenant: dict[str, str]
) -> None:
    """PROTOCOL.md 10.1: a chunk short of the tail may be cached, by the client alone when
    streams are access-controlled. ``public`` let a shared cache keep one key's read and give
    it to anyone asking the same URL, whom the server answers 401."""
    path = _stream_of_three(server, tenant)
    chunk = httpx.get(server.stream_url(path), params={"offset": "-1"}, headers=tenant)
    assert chunk.status_code == 200 and chunk.text == "onetwo"
    assert "Stream-Up-To-Date" not in chunk.headers
    assert chunk.headers["Cache-Control"] == "private, max-age=60, stale-while-revalidate=300"
    anonymous = httpx.get(server.stream_url(path), params={"offset": "-1"})
    assert anonymous.status_code == 401
    assert anonymous.headers["Cache-Control"] == "no-store"


def test_if_none_match_compares_weakly(server: ServerProcess, tenant: dict[str, str]) -> None:
    """RFC 9110 13.1.2: ``If-None-Match`` uses the weak comparison (``W/`` is ignored), and
    ``*`` matches any representation: both were answered 200 with the body again."""
    path = _stream_of_three(server, tenant)
    url, params = server.stream_url(path), {"offset": "-1"}
    etag = httpx.get(url, params=params, headers=tenant).headers["ETag"]
    for condition in (etag, f"W/{etag}", f'"other", W/{etag}', "*"):
        again = httpx.get(url, params=params, headers=tenant | {"If-None-Match": condition})
        assert again.status_code == 304, condition
        assert again.content == b""
    other = httpx.get(url, params=params, headers=tenant | {"If-None-Match": '"other"'})
    assert other.status_code == 200 and other.text == "onetwo"


def test_the_rest_api_answers_preflights_and_is_not_cached(
    server: ServerProcess, tenant: dict[str, str]
) -> None:
    """The REST API's preflights were 401 (they carry no credentials) and its answers had no
    CORS headers and no Cache-Control, though the README promised preflights without
    credentials; the protocol endpoints had both."""
    for route in ("/v1/streams", "/v1/state/streams", "/v1/auth/whoami", "/v1/auth/signed-urls"):
        preflight = httpx.options(
            server.base_url + route,
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 204, (route, preflight.text)
        assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
        assert preflight.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert preflight.headers["X-Content-Type-Options"] == "nosniff"
        assert "Content-Type" not in preflight.headers
    listed = httpx.get(server.base_url + "/v1/streams", headers=tenant | {"Origin": ORIGIN})
    assert listed.status_code == 200
    assert listed.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "Origin" in listed.headers["Vary"]
    assert listed.headers["Cache-Control"] == "no-store"
    stranger = httpx.get(
        server.base_url + "/v1/streams", headers=tenant | {"Origin": "https://evil.example"}
    )
    assert "Access-Control-Allow-Origin" not in stranger.headers
    minted = httpx.post(
        server.base_url + "/v1/auth/signed-urls",
        json={"prefix": "stream/tenant-a/", "expires_in": 60},
        headers=tenant,
    )
    assert minted.status_code == 201, minted.text
    assert minted.headers["Cache-Control"] == "no-store"


@pytest.mark.parametrize(
    "target",
    [
        {"stream": "tenant-a/../tenant-b/x"},
        {"stream": "tenant-a//x"},
        {"stream": "tenant-a/./x"},
        {"prefix": "stream/tenant-a/../tenant-b/"},
        {"prefix": "stream/tenant-a//"},
        {"prefix": "yjs/tenant-a/"},
    ],
)
def test_signed_urls_are_minted_only_for_valid_stream_paths(
    server: ServerProcess, tenant: dict[str, str], target: dict[str, str]
) -> None:
    """A path with dot segments was signed (201), and its URL, resolved by the URL builder,
    pointed into another tenant's stream."""
    minted = httpx.post(
        server.base_url + "/v1/auth/signed-urls", json=target | {"expires_in": 60}, headers=tenant
    )
    assert minted.status_code == 400, minted.text


@pytest.mark.parametrize(
    ("expires_in", "status"),
    [
        (60, 201),
        ("60", 201),
        ("\u0663\u0660\u0660", 400),
        (" 30 ", 400),
        ("1_0", 400),
        ("30.0", 400),
    ],
)
def test_a_signed_urls_lifetime_is_an_integer_as_json_writes_one(
    server: ServerProcess, tenant: dict[str, str], expires_in: object, status: int
) -> None:
    """Probe 9b: the lifetime took whatever Python's int() takes, Arabic-Indic digits and
    spaces included (DRF's IntegerField)."""
    minted = httpx.post(
        server.base_url + "/v1/auth/signed-urls",
        json={"stream": "tenant-a/x", "expires_in": expires_in},
        headers=tenant,
    )
    assert minted.status_code == status, minted.text


def test_a_path_cannot_write_lines_into_the_log(server: ServerProcess) -> None:
    """The request line logged the decoded path as it came: ``%0a`` began a forged line (with
    a request id and a status of the sender's choosing), ``%0d`` and terminal escapes hid
    what came before; and (probe 7d) a right-to-left override or isolate showed the rest of
    its line reversed."""
    forged = "2026-01-01 00:00:00,000 INFO ds.request [deadbeef]: DELETE /v1/stream/b 204"
    for prefix in ("/v1/stream/x", "/console/x"):
        path = f"{prefix}%0a{forged.replace(' ', '%20')}%0d%1b[2J%00%E2%80%AEdrow%E2%81%A6"
        with httpx.Client() as client:
            client.get(server.base_url + path)
    deadline = time.monotonic() + 10
    while "console/x" not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the request lines were not logged"
        time.sleep(0.1)
    lines = server.log_path.read_text(errors="replace").splitlines()
    assert not [line for line in lines if line.startswith("2026-01-01")]
    assert not [
        line for line in lines if re.search(r"[\x00\x1b\r\u202a-\u202e\u2066-\u2069]", line)
    ]
    assert [line for line in lines if "/v1/stream/x\\n2026-01-01" in line]


def test_the_admin_cookies_are_kept_to_https(server: ServerProcess, database_url: str) -> None:
    """``DJANGO_SECURE_COOKIES`` marks the session and CSRF cookies Secure, and behind a proxy
    that says so (``DJANGO_PROXY_SSL_HEADER``) answers carry HSTS; there were no settings."""
    https = {"X-Forwarded-Proto": "https"}
    with httpx.Client(base_url=server.base_url, headers=https) as client:
        login = client.get("/admin/login/")
        assert login.status_code == 200
        cookie = login.headers["Set-Cookie"]
        assert cookie.startswith("csrftoken=") and "Secure" in cookie
        assert login.headers["Strict-Transport-Security"] == "max-age=600"


def test_every_answer_over_https_carries_hsts(
    server: ServerProcess, tenant: dict[str, str]
) -> None:
    """Django's pages carried HSTS over HTTPS; the protocol endpoints, where keys and signed
    URLs travel, and the probes did not (probe 10h). Every answer over HTTPS does, once; none
    over plain HTTP."""
    path = _stream_of_three(server, tenant)
    base = server.base_url
    urls = (server.stream_url(path), f"{base}/healthz", f"{base}/v1/streams",
            f"{base}/v1/yjs/tenant-a/doc", f"{base}/admin/login/")  # fmt: skip
    for url in urls:
        over_https = httpx.get(url, headers=tenant | {"X-Forwarded-Proto": "https"})
        hsts = over_https.headers.get_list("Strict-Transport-Security")
        assert hsts == ["max-age=600"], (url, over_https.status_code, hsts)
        assert "Strict-Transport-Security" not in httpx.get(url, headers=tenant).headers, url
