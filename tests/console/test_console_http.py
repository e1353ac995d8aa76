"""The console over HTTP: access, bad input (4xx, nothing changed), escaping, security headers,
signed read URLs in keys mode, the overview's figures, and the admin's links to it."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.browser.support import create_user
from tests.conftest import ServerProcess, manage
from tests.console.conftest import csrf, logged_in, referer, staff_user
from tests.state.support import change
from tests.yjs.support import Writer, frames, unique

JSON = {"Content-Type": "application/json"}
TEXT = {"Content-Type": "text/plain"}


def tail(api: httpx.Client, path: str) -> str:
    return api.head(f"/v1/stream/{quote(path)}").headers["Stream-Next-Offset"]


def page_config(html: str) -> dict[str, Any]:
    found = re.search(r'<script id="console-config" type="application/json">(.*?)</script>', html)
    assert found is not None
    return json.loads(found.group(1))


def append_from_console(client: httpx.Client, path: str, body: str) -> httpx.Response:
    token = csrf(client, f"/console/stream/{quote(path)}")
    return client.post(
        f"/console/append/{quote(path)}", data=token | {"body": body}, headers=referer(client)
    )


# -- who may use it ----------------------------------------------------------------------------


def test_anonymous_visitors_are_sent_to_log_in(keys_server: ServerProcess) -> None:
    with httpx.Client(base_url=keys_server.base_url) as client:
        for url in ("/console/", "/console/streams/", "/console/stream/a/b"):
            response = client.get(url)
            assert response.status_code == 302, url
            assert response.headers["Location"] == f"/admin/login/?next={quote(url)}"
        # What pages fetch answers 401: a fetch would take the login form for its answer.
        for url in ("/console/overview.json", "/console/messages/a", "/console/live-url/a"):
            response = client.get(url)
            assert response.status_code == 401, url
            assert response.json()["code"] == "UNAUTHORIZED"


def test_users_no_longer_staff_are_sent_to_log_in(
    keys_server: ServerProcess, database_url: str
) -> None:
    """The admin's login takes staff only; a session of someone who since lost staff status
    (or was deactivated) no longer opens the console."""
    username = f"former{time.time_ns()}"
    staff_user(database_url, username, "streams.view_stream")
    with logged_in(keys_server, username) as client:
        assert client.get("/console/").status_code == 200
        script = (
            "from django.contrib.auth import get_user_model;"
            f"get_user_model().objects.filter(username={username!r}).update(is_staff=False)"
        )
        assert manage(database_url, "shell", "-c", script).returncode == 0
        assert client.get("/console/").status_code == 302
        assert client.get("/console/overview.json").status_code == 401
        assert client.get(f"/console/live-url/{unique('x')}").status_code == 401


def test_staff_need_the_permissions(
    keys_server: ServerProcess, database_url: str, api: httpx.Client
) -> None:
    path = unique("perm")
    api.put(f"/v1/stream/{path}", headers=TEXT)
    nobody = f"staffnoperm{time.time_ns()}"
    staff_user(database_url, nobody)
    with logged_in(keys_server, nobody) as client:
        assert client.get("/console/").status_code == 403
        assert client.get(f"/console/stream/{path}").status_code == 403

    viewer = f"viewer{time.time_ns()}"
    staff_user(database_url, viewer, "streams.view_stream")
    with logged_in(keys_server, viewer) as client:
        page = client.get(f"/console/stream/{path}")
        assert page.status_code == 200
        assert 'id="append-form"' not in page.text
        assert "Can append messages" in page.text
        refused = client.post(
            f"/console/append/{path}",
            data=csrf(client, f"/console/stream/{path}") | {"body": "no"},
            headers=referer(client),
        )
        assert refused.status_code == 403
    assert tail(api, path) == "0000000000000000_0000000000000000"

    writer = f"writer{time.time_ns()}"
    staff_user(database_url, writer, "streams.view_stream", "console.append_messages")
    with logged_in(keys_server, writer) as client:
        appended = append_from_console(client, path, "yes")
        assert appended.status_code == 200, appended.text
    assert api.get(f"/v1/stream/{path}", params={"offset": "-1"}).text == "yes"


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "min_bytes=abc",
        "min_bytes=-1",
        "max_bytes=1e400",
        "min_bytes=5&max_bytes=1",
        "tail_from=xyz",
        "tail_from=0000000000000001_00000000000000%D9%A1",
        "closed=maybe",
        "status=gone",
        "expiry=soon",
        f"path_prefix={'x' * 2000}",
    ],
)
def test_bad_searches_are_400s(superuser: httpx.Client, query: str) -> None:
    page = superuser.get(f"/console/streams/?{query}")
    assert page.status_code == 400, page.text[:300]
    assert 'class="problem"' in page.text
    fragment = superuser.get(f"/console/streams/?{query}&fragment=rows")
    assert fragment.status_code == 400
    assert fragment.json()["code"] == "BAD_REQUEST"


def test_bad_reads_are_4xx(superuser: httpx.Client, api: httpx.Client) -> None:
    path = unique("bad-read")
    api.put(f"/v1/stream/{path}", headers=JSON, content=b'[{"a":1},{"b":22}]')
    url = f"/console/messages/{path}"
    assert superuser.get(url).json()["messages"][1]["offset"] == "0000000000000001_0000000000000007"
    for query, status in [
        ("before=garbage", 400),
        ("before=0000000000000001_0000000000000003", 400),  # not where a message starts
        ("before=0000000000000009_0000000000000000", 400),  # past the tail
        ("limit=0", 400),
        ("limit=501", 400),
        ("limit=many", 400),
    ]:
        response = superuser.get(f"{url}?{query}")
        assert response.status_code == status, (query, response.text)
        assert response.json()["code"] == "BAD_REQUEST"
    assert superuser.get("/console/messages/no/such/stream").status_code == 404
    assert superuser.get("/console/stream/no/such/stream").status_code == 404
    assert superuser.get(f"/console/stream/{'x' * 1100}").status_code == 400
    assert superuser.get(f"/console/state/{path}").status_code == 404  # not a state stream
    assert superuser.get(f"/console/entities/{path}").status_code == 400
    assert superuser.get("/console/yjs/svc/no-such-doc").status_code == 404
    assert superuser.get("/console/yjs-content/svc/no-such-doc").status_code == 404
    assert superuser.post("/console/streams/").status_code in (403, 405)
    assert superuser.get(f"/console/append/{path}").status_code == 405
    assert superuser.get("/console/streams/?path_prefix=%00").status_code == 400


def test_bad_appends_are_4xx_and_change_nothing(superuser: httpx.Client, api: httpx.Client) -> None:
    path = unique("bad-append")
    api.put(f"/v1/stream/{path}", headers=JSON)
    closed = unique("closed")
    api.put(f"/v1/stream/{closed}", headers=TEXT | {"Stream-Closed": "true"})
    before = tail(api, path)
    for body, status in [('{"a": ', 400), ("[]", 400), ("NaN", 400), ("", 400), ("a\x00b", 400)]:
        response = append_from_console(superuser, path, body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]
    assert tail(api, path) == before
    assert append_from_console(superuser, closed, "late").status_code == 409
    for internal in ("__registry__", "__ds/yjs/svc/docs/d"):
        token = csrf(superuser, "/console/")
        refused = superuser.post(
            f"/console/append/{internal}", data=token | {"body": "{}"}, headers=referer(superuser)
        )
        assert refused.status_code == 403, refused.text
    token = csrf(superuser, "/console/")
    missing = superuser.post(
        "/console/append/no/such", data=token | {"body": "x"}, headers=referer(superuser)
    )
    assert missing.status_code == 404
    # Without the CSRF token: refused before anything is read.
    forged = superuser.post(f"/console/append/{path}", data={"body": "{}"})
    assert forged.status_code == 403
    assert tail(api, path) == before


def test_a_plain_form_post_is_sent_back_to_the_page(
    superuser: httpx.Client, api: httpx.Client
) -> None:
    path = unique("plain-form")
    api.put(f"/v1/stream/{path}", headers=JSON)
    token = csrf(superuser, f"/console/stream/{path}")
    response = superuser.post(f"/console/append/{path}", data=token | {"body": "[1, 2]"})
    assert response.status_code == 302
    assert response.headers["Location"] == f"/console/stream/{path}"
    assert "Appended" in superuser.get(f"/console/stream/{path}").text
    assert api.get(f"/v1/stream/{path}", params={"offset": "-1"}).json() == [1, 2]


# -- escaping and headers ----------------------------------------------------------------------


def test_user_content_is_escaped_in_every_page(superuser: httpx.Client, api: httpx.Client) -> None:
    attack = "<script>alert(1)</script>"
    path = f"{unique('esc')}/{attack}\"'"
    assert api.put(f"/v1/stream/{quote(path)}", headers=JSON).status_code == 201
    assert api.post("/v1/state/streams", json={"stream": path, "schemas": {}}).is_success
    event = change(attack, attack, {attack: attack})
    api.post(f"/v1/stream/{quote(path)}", headers=JSON, content=json.dumps([event]))
    doc = unique("esc-doc")
    api.put(f"/v1/yjs/esc/docs/{doc}")
    api.post(f"/v1/yjs/esc/docs/{doc}", headers={"Content-Type": "application/octet-stream"},
             content=frames(Writer().edit(attack)))  # fmt: skip

    pages = [
        f"/console/streams/?path_prefix={quote(path)}",
        f"/console/streams/?path_prefix={quote(path)}&fragment=rows",
        f"/console/stream/{quote(path)}",
        f"/console/state/{quote(path)}",
        f"/console/entities/{quote(path)}",
        f"/console/yjs/esc/{doc}",
    ]
    for url in pages:
        response = superuser.get(url)
        assert response.status_code == 200, url
        assert "<script>alert" not in response.text, url
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in response.text, url


def test_pages_carry_security_headers(superuser: httpx.Client) -> None:
    for url in ("/console/", "/console/streams/", "/console/overview.json"):
        response = superuser.get(url)
        policy = response.headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert response.headers["X-Frame-Options"] == "DENY"
        assert (
            "no-store" in response.headers["Cache-Control"]
            or "max-age=0" in (response.headers["Cache-Control"])
        )
        assert "'unsafe-inline'" not in policy


def test_refusals_carry_the_security_headers_and_speak_json_to_scripts(
    superuser: httpx.Client,
) -> None:
    """A missing stream, state stream or document was Django's own 404 page (probe 7d): no
    Content-Security-Policy, no Cache-Control, and HTML where the pages' scripts read JSON."""
    missing = unique("missing")
    for url, page in (
        (f"/console/stream/{missing}", True),
        (f"/console/state/{missing}", True),
        (f"/console/yjs/esc/{missing}", True),
        (f"/console/messages/{missing}?before=0000000000000000_0000000000000000", False),
    ):
        response = superuser.get(url)
        assert response.status_code == 404, url
        assert "script-src 'self'" in response.headers["Content-Security-Policy"], url
        assert "no-store" in response.headers["Cache-Control"], url
        if not page:
            assert response.json()["code"] == "NOT_FOUND", url
    # A method a page does not take was Django's bare 405 (found by review).
    wrong = superuser.post(
        "/console/streams/", data=csrf(superuser, "/console/"), headers=referer(superuser)
    )
    assert wrong.status_code == 405
    assert "script-src 'self'" in wrong.headers["Content-Security-Policy"]
    # A form without its CSRF token was Django's bare 403 page (left by probe 7d).
    forged = superuser.post(f"/console/append/{missing}", data={"body": "x"})
    assert forged.status_code == 403
    assert "script-src 'self'" in forged.headers["Content-Security-Policy"]
    assert "no-store" in forged.headers["Cache-Control"]


def test_the_state_page_shows_a_bounded_number_of_entity_types(
    superuser: httpx.Client, api: httpx.Client
) -> None:
    """A writer chooses entity types: the page showed every one (5,000 made a page of 2 MB
    that took 3.5 s to build, again after each append). It shows the first 50 by name and
    says how many more there are."""
    path = unique("types")
    assert api.put(f"/v1/stream/{path}", headers=JSON).status_code == 201
    assert api.post("/v1/state/streams", json={"stream": path, "schemas": {}}).is_success
    events = [change(f"type-{n:03}", "k", {"n": n}) for n in range(60)]
    assert api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps(events)).is_success
    fragment = superuser.get(f"/console/entities/{path}")
    assert fragment.status_code == 200
    assert fragment.text.count('class="panel entity-type"') == 50
    assert 'data-type="type-049"' in fragment.text and 'data-type="type-050"' not in fragment.text
    assert "10 more entity types not shown" in fragment.text
    one = superuser.get(f"/console/entities/{path}", params={"type": "type-059"})
    assert one.text.count('class="panel entity-type"') == 1 and "more entity" not in one.text


def test_the_state_page_names_a_large_value_by_its_size(
    superuser: httpx.Client, api: httpx.Client
) -> None:
    """The page read every value it listed whole (up to 50 types of 200 entities, whatever
    each held; probe 10b found the same on the REST API's pages): a value past 4,096 bytes of
    JSON is named by its size and not read; smaller ones are shown whole, indented."""
    path = unique("large-values")
    assert api.put(f"/v1/stream/{path}", headers=JSON).status_code == 201
    assert api.post("/v1/state/streams", json={"stream": path, "schemas": {}}).is_success
    events = [change("doc", "large", {"text": "x" * 200_000}), change("doc", "small", {"n": 1})]
    assert api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps(events)).is_success
    fragment = superuser.get(f"/console/entities/{path}")
    assert fragment.status_code == 200
    assert len(fragment.text) < 20_000 and "xxxx" not in fragment.text
    assert "(a value of 200,012 bytes: read it through the API)" in fragment.text
    assert "{\n  &quot;n&quot;: 1\n}" in fragment.text


# -- signed read URLs --------------------------------------------------------------------------


def test_pages_read_through_signed_urls_in_keys_mode(
    keys_server: ServerProcess, database_url: str, api: httpx.Client
) -> None:
    username = f"signer{time.time_ns()}"
    create_user(database_url, username)
    path, other = unique("signed"), unique("other")
    api.put(f"/v1/stream/{path}", headers=TEXT, content=b"secret-ish")
    api.put(f"/v1/stream/{other}", headers=TEXT, content=b"elsewhere")
    with (
        logged_in(keys_server, username) as client,
        httpx.Client(base_url=keys_server.base_url) as anonymous,
    ):
        live = page_config(client.get(f"/console/stream/{path}").text)["live"]
        assert live["expires"] > time.time() + 600
        assert anonymous.get(f"/v1/stream/{path}", params={"offset": "-1"}).status_code == 401
        read = anonymous.get(f"{live['url']}&offset=-1")
        assert read.status_code == 200 and read.text == "secret-ish"
        # Only that stream, and only reading.
        elsewhere = live["url"].replace(f"/v1/stream/{path}?", f"/v1/stream/{other}?")
        assert anonymous.get(f"{elsewhere}&offset=-1").status_code in (401, 403)
        write = anonymous.post(live["url"], headers=TEXT, content=b"x")
        assert write.status_code in (401, 403)
        fresh = client.get(f"/console/live-url/{path}").json()
        assert fresh["url"].startswith(f"/v1/stream/{path}?")

        # The user's console key reads and nothing else; deleting the user revokes it.
        script = (
            "from access.models import ApiKey;"
            f"k = ApiKey.objects.get(owner__username={username!r});"
            "print([str(g) for g in k.grants.all()], k.revoked)"
        )
        assert manage(database_url, "shell", "-c", script).stdout.strip().splitlines()[-1] == (
            "['*:read'] False"
        )
        deleted = manage(
            database_url, "shell", "-c",
            f"from django.contrib.auth import get_user_model;"
            f"get_user_model().objects.get(username={username!r}).delete()",
        )  # fmt: skip
        assert deleted.returncode == 0, deleted.stderr
        # The revocation's NOTIFY drops the servers' cached keys (kept 60 s without it).
        revoked = time.monotonic() + 10
        while (status := anonymous.get(f"{live['url']}&offset=-1").status_code) != 401:
            assert time.monotonic() < revoked, f"the deleted user's key still answers {status}"
            time.sleep(0.1)


# -- the overview ------------------------------------------------------------------------------


def test_the_overview_counts_streams_appends_and_live_readers(
    superuser: httpx.Client, api: httpx.Client, ops_key: str, keys_server: ServerProcess
) -> None:
    path = unique("figures")
    api.put(f"/v1/stream/{path}", headers=TEXT)
    first = superuser.get("/console/overview.json").json()
    assert first["streams"] >= 1 and first["metrics"] is True
    for i in range(40):
        api.post(f"/v1/stream/{path}", headers=TEXT, content=str(i))

    stop = threading.Event()

    def follow() -> None:
        headers = {"Authorization": f"Bearer {ops_key}"}
        url = keys_server.stream_url(path)
        with httpx.stream("GET", url, params={"offset": "now", "live": "sse"}, headers=headers,
                          timeout=30) as response:  # fmt: skip
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 15
        figures: dict[str, Any] = {}
        while time.monotonic() < deadline:
            figures = superuser.get("/console/overview.json").json()
            if (figures["appends_per_second"] or 0) > 0 and (figures["live_readers"] or 0) >= 1:
                break
            time.sleep(0.5)
        assert (figures["appends_per_second"] or 0) > 0, figures
        assert figures["live_readers"] >= 1, figures
        assert figures["history"] and all(rate >= 0 for _, rate in figures["history"])
    finally:
        stop.set()
        api.post(f"/v1/stream/{path}", headers=TEXT, content="bye")  # wakes the reader
        reader.join(timeout=10)


# -- the admin links to it ---------------------------------------------------------------------


def test_the_admin_links_to_the_console(superuser: httpx.Client, api: httpx.Client) -> None:
    path = unique("admin-link")
    api.put(f"/v1/stream/{path}", headers=JSON)
    admin = superuser.get("/admin/")
    assert 'href="/console/"' in admin.text
    stream_id = re.search(
        r'href="/admin/streams/stream/(\d+)/change/',
        superuser.get("/admin/streams/stream/", params={"q": path}).text,
    )
    assert stream_id is not None
    change_page = superuser.get(f"/admin/streams/stream/{stream_id.group(1)}/change/")
    assert f'href="/console/stream/{path}"' in change_page.text
    console = superuser.get(f"/console/stream/{path}")
    assert f'href="/admin/streams/stream/{stream_id.group(1)}/change/"' in console.text
