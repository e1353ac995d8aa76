"""The Django admin browses streams, their messages and producer ledgers (read-only), served
by the real server."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from streams.preview import PREVIEW_CHARS
from tests.conftest import admin_session
from tests.state.support import change
from tests.yjs.support import frames

TEXT = {"Content-Type": "text/plain"}


@pytest.fixture(scope="module")
def admin_client(server: Any, database_url: str) -> Iterator[httpx.Client]:
    with admin_session(server.base_url, database_url, f"admin{time.time_ns()}", 10) as client:
        yield client


def test_admin_lists_filters_and_shows_streams(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    stamp = time.time_ns()
    json_path = f"admin/{stamp}/events"
    binary_path = f"admin/{stamp}/blob"
    client.put(f"/v1/stream/{json_path}", headers={"Content-Type": "application/json"})
    producer = {"Producer-Id": "writer-1", "Producer-Epoch": "3", "Producer-Seq": "0"}
    client.post(
        f"/v1/stream/{json_path}",
        headers={"Content-Type": "application/json"} | producer,
        content='[{"kind":"created","id":7},{"kind":"updated"}]',
    )
    client.put(
        f"/v1/stream/{binary_path}",
        headers={"Content-Type": "application/octet-stream", "Stream-TTL": "3600"},
        content=bytes([0, 1, 2, 255]),
    )
    client.put(
        f"/v1/stream/{json_path}-fork",
        headers={"Stream-Forked-From": f"/v1/stream/{json_path}"},
    )

    listing = admin_client.get("/admin/streams/stream/", params={"q": str(stamp)})
    assert listing.status_code == 200
    assert json_path in listing.text and binary_path in listing.text

    forks = admin_client.get("/admin/streams/stream/", params={"q": str(stamp), "forked": "fork"})
    assert f"{json_path}-fork" in forks.text and binary_path not in forks.text
    by_type = admin_client.get(
        "/admin/streams/stream/",
        params={"q": str(stamp), "content_type": "application/octet-stream"},
    )
    assert binary_path in by_type.text and json_path not in by_type.text
    live = admin_client.get("/admin/streams/stream/", params={"q": str(stamp), "expired": "no"})
    assert json_path in live.text

    stream_id = re.search(
        rf'href="/admin/streams/stream/(\d+)/change/[^"]*">{json_path}<', listing.text
    )
    assert stream_id is not None
    detail = admin_client.get(f"/admin/streams/stream/{stream_id.group(1)}/change/")
    assert "writer-1" in detail.text  # the producer ledger
    assert "0000000000000002_" in detail.text  # the tail offset
    # Without a TTL the last access is not kept (it would show the creation time).
    assert "not tracked (no TTL)" in detail.text

    messages = admin_client.get(f"/admin/streams/stream/{stream_id.group(1)}/messages/")
    assert messages.status_code == 200
    assert "&quot;kind&quot;: &quot;created&quot;" in messages.text  # pretty-printed JSON
    binary_id = re.search(
        rf'href="/admin/streams/stream/(\d+)/change/[^"]*">{binary_path}<', listing.text
    )
    assert binary_id is not None
    blob = admin_client.get(f"/admin/streams/stream/{binary_id.group(1)}/messages/")
    assert "00 01 02 ff" in blob.text  # hex preview
    with_ttl = admin_client.get(f"/admin/streams/stream/{binary_id.group(1)}/change/")
    assert "Last access (sliding TTL)" in with_ttl.text
    assert "not tracked" not in with_ttl.text

    # The previews' stylesheet, from the project's static/ directory.
    stylesheet = re.search(r'href="([^"]*durable_streams/admin\.css)"', messages.text)
    assert stylesheet is not None
    css = admin_client.get(stylesheet.group(1))
    assert css.status_code == 200 and ".ds-preview" in css.text


def run_action(
    admin_client: httpx.Client, listing: httpx.Response, action: str, object_id: str
) -> httpx.Response:
    """Submit an admin action for one object from the change list page ``listing``, as its
    form does (CSRF token, Referer)."""
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', listing.text)
    assert token is not None
    return admin_client.post(
        str(listing.url),
        data={"csrfmiddlewaretoken": token.group(1), "action": action,
              "_selected_action": [object_id]},
        headers={"Referer": str(admin_client.base_url)},
    )  # fmt: skip


def test_admin_is_read_only_and_deletes_through_the_protocol(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    path = f"admin/{time.time_ns()}/to-delete"
    client.put(f"/v1/stream/{path}", headers={"Content-Type": "text/plain"}, content="x")
    listing = admin_client.get("/admin/streams/stream/", params={"q": path})
    stream_id = re.search(r'href="/admin/streams/stream/(\d+)/change/', listing.text)
    assert stream_id is not None
    assert admin_client.get("/admin/streams/stream/add/").status_code == 403
    response = run_action(admin_client, listing, "delete_streams", stream_id.group(1))
    assert response.status_code == 200
    assert "1 deleted" in response.text
    assert client.get(f"/v1/stream/{path}").status_code == 404


def test_admin_shows_state_streams_and_entities(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    """State streams with schemas and materialized offset; entities filterable by stream and
    type, searchable by key, values as pretty JSON."""
    path = f"admin/{time.time_ns()}/state"
    client.put(f"/v1/stream/{path}", headers={"Content-Type": "application/json"})
    # Keys no other test's page text contains (stream paths of other tests are listed too).
    user_key, team_key = f"user-{secrets.token_hex(6)}", f"team-{secrets.token_hex(6)}"
    events = [change("user", user_key, {"name": "Ada"}), change("team", team_key, {"size": 3})]
    client.post(f"/v1/stream/{path}", headers={"Content-Type": "application/json"}, json=events)
    registered = client.post(
        "/v1/state/streams",
        json={"stream": path, "schemas": {"user": {"type": "object"}}},
    )
    assert registered.status_code == 201

    streams = admin_client.get("/admin/state/statestream/", params={"q": path})
    assert path in streams.text and registered.json()["materialized_offset"] in streams.text
    stream_id = re.search(r'href="/admin/state/statestream/(\d+)/change/', streams.text)
    assert stream_id is not None
    detail = admin_client.get(f"/admin/state/statestream/{stream_id.group(1)}/change/")
    assert "&quot;type&quot;: &quot;object&quot;" in detail.text  # schemas, pretty-printed

    users = admin_client.get(
        "/admin/state/entitystate/", params={"stream": stream_id.group(1), "type": "user"}
    )
    assert user_key in users.text and team_key not in users.text
    found = admin_client.get("/admin/state/entitystate/", params={"q": team_key})
    assert team_key in found.text
    entity_id = re.search(r'href="/admin/state/entitystate/(\d+)/change/', users.text)
    assert entity_id is not None
    entity = admin_client.get(f"/admin/state/entitystate/{entity_id.group(1)}/change/")
    assert "&quot;name&quot;: &quot;Ada&quot;" in entity.text
    assert 'class="ds-preview"' in entity.text and "durable_streams/admin.css" in entity.text

    # A stream filter edited by hand is the admin's "invalid filter" answer, not a 500 (found
    # by an adversarial probe).
    for bad in ("abc", "1.5", "9" * 40, "١٢"):
        answer = admin_client.get("/admin/state/entitystate/", params={"stream": bad})
        assert answer.status_code in (200, 302), (bad, answer.status_code)


def test_admin_shows_and_compacts_yjs_documents(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    """Yjs documents with bytes since the last snapshot, snapshot offset and time, a preview of
    the content decoded with pycrdt, and an action to compact now."""
    from pycrdt import Doc, Text

    doc_path = f"admin-{time.time_ns()}"
    url = f"/v1/yjs/admin/docs/{doc_path}"
    doc = Doc()
    text = doc.get("body", type=Text)
    updates: list[bytes] = []
    doc.observe(lambda event: updates.append(event.update))
    text += "Hello from the admin test"
    assert client.put(url).status_code == 201
    body = frames(*updates)
    post = client.post(url, content=body, headers={"Content-Type": "application/octet-stream"})
    assert post.status_code == 204

    listing = admin_client.get("/admin/yjs/yjsdocument/", params={"q": doc_path})
    assert doc_path in listing.text
    assert f">{len(body)}<" in listing.text  # bytes since the (missing) snapshot
    doc_id = re.search(r'href="/admin/yjs/yjsdocument/(\d+)/change/', listing.text)
    assert doc_id is not None
    detail = admin_client.get(f"/admin/yjs/yjsdocument/{doc_id.group(1)}/change/")
    assert "Hello from the admin test" in detail.text and "body (Text)" in detail.text

    compacted = run_action(admin_client, listing, "compact_now", doc_id.group(1))
    assert "Compacted 1 of 1 documents" in compacted.text
    location = client.get(url, params={"offset": "snapshot"}).headers["Location"]
    assert location.endswith("_snapshot")
    assert location.split("offset=")[1] in compacted.text  # the new snapshot offset is listed


def change_form(admin_client: httpx.Client, url: str, **fields: str) -> httpx.Response:
    """Submit an admin change form at ``url`` with ``fields`` (and its CSRF token)."""
    page = admin_client.get(url)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None
    return admin_client.post(
        url,
        data={"csrfmiddlewaretoken": token.group(1), "_save": "Save", **fields},
        headers={"Referer": str(admin_client.base_url)},
    )


def test_staff_change_a_streams_retention_policy(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    """Issue 14: staff change a stream's retention policy in the admin (shown by HEAD); the
    rest of the stream stays as appends left it; a policy that is not a positive number is
    refused and changes nothing."""
    path = f"admin/{time.time_ns()}/retained"
    client.put(f"/v1/stream/{path}", headers={"Content-Type": "text/plain"}, content="x")
    listing = admin_client.get("/admin/streams/stream/", params={"q": path})
    stream_id = re.search(r'href="/admin/streams/stream/(\d+)/change/', listing.text)
    assert stream_id is not None
    url = f"/admin/streams/stream/{stream_id.group(1)}/change/"
    page = admin_client.get(url)
    assert "Retention" in page.text and "Starts at" in page.text
    client.post(f"/v1/stream/{path}", headers={"Content-Type": "text/plain"}, content="yz")

    saved = change_form(admin_client, url, retention_max_age="3600", retention_max_bytes="")
    assert saved.status_code == 200 and "was changed successfully" in saved.text
    head = client.head(f"/v1/stream/{path}").headers
    assert head["Stream-Retention-Max-Age"] == "3600"
    assert "Stream-Retention-Max-Bytes" not in head
    assert client.get(f"/v1/stream/{path}", params={"offset": "-1"}).text == "xyz"

    refused = change_form(admin_client, url, retention_max_age="0", retention_max_bytes="")
    assert "errornote" in refused.text
    assert client.head(f"/v1/stream/{path}").headers["Stream-Retention-Max-Age"] == "3600"


def test_staff_compact_state_streams(admin_client: httpx.Client, client: httpx.Client) -> None:
    """Issue 14: staff turn compaction on for a state stream and compact it now; its state
    stays, the stream keeps the latest event of each key."""
    path = f"admin/{time.time_ns()}/compacted"
    client.put(f"/v1/stream/{path}", headers={"Content-Type": "application/json"})
    assert client.post("/v1/state/streams", json={"stream": path}).status_code == 201
    events = [change("user", "u-1", {"v": i}, "update") for i in range(20)]
    client.post(f"/v1/stream/{path}", headers={"Content-Type": "application/json"}, json=events)

    listing = admin_client.get("/admin/state/statestream/", params={"q": path})
    stream_id = re.search(r'href="/admin/state/statestream/(\d+)/change/', listing.text)
    assert stream_id is not None
    url = f"/admin/state/statestream/{stream_id.group(1)}/change/"
    saved = change_form(admin_client, url, compaction="on", tombstone_seconds="60")
    assert "was changed successfully" in saved.text
    registration = client.get(f"/v1/state/streams/{path}").json()
    assert (registration["compaction"], registration["tombstone_seconds"]) == (True, 60)

    compacted = run_action(admin_client, listing, "compact_now", stream_id.group(1))
    assert f"{path}: 1 events kept, 19 deleted" in compacted.text
    assert client.get(f"/v1/stream/{path}", params={"offset": "-1"}).json() == [events[-1]]
    entities = client.get("/v1/state/entities", params={"stream": path}).json()["results"]
    assert [e["value"] for e in entities] == [{"v": 19}]


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    assert found is not None
    return int(found.group(1)) / 1024


def test_the_messages_page_reads_only_what_it_previews(
    start_server: Any, database_url: str
) -> None:
    """The messages page read each message of its page whole to show 2,000 characters of it:
    a page of 16 MiB messages took the worker's peak memory up by about three times their
    size, and it stayed grown (probe 7d: 10 of them, 175 to 688 MiB, 3.2 s). It reads the
    first 64 KiB of each, and still gives each message's whole size."""
    server = start_server()
    path = f"admin/large-{time.time_ns()}"
    message = b"m" * (16 << 20)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.put(f"/v1/stream/{path}", headers=TEXT).status_code == 201
        for _ in range(6):
            assert http.post(f"/v1/stream/{path}", headers=TEXT, content=message).is_success
    username = f"admin{time.time_ns()}"
    with admin_session(server.base_url, database_url, username, 60) as admin_client:
        listing = admin_client.get("/admin/streams/stream/", params={"q": path})
        stream_id = re.search(r'href="/admin/streams/stream/(\d+)/change/', listing.text)
        assert stream_id is not None
        before = _peak_rss_mib(server.process.pid)
        page = admin_client.get(f"/admin/streams/stream/{stream_id.group(1)}/messages/")
        after = _peak_rss_mib(server.process.pid)
    assert page.status_code == 200
    assert page.text.count(f"<td>{16 << 20}</td>") == 6  # each message's whole size
    assert after - before < 48, (before, after)


def test_the_stream_list_filters_by_a_bounded_number_of_content_types(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    """Clients choose content types (their parameters are free text): the stream list's
    filter linked every distinct one on every page (probe 7d: 5,000 made each page 2.7 MB).
    It links at most 200, and filtering by one still works."""
    stamp = time.time_ns()
    for n in range(205):
        created = client.put(
            f"/v1/stream/admin/types-{stamp}/{n}",
            headers={"Content-Type": f"text/plain; variant=v{stamp}-{n}"},
        )
        assert created.status_code == 201
    listing = admin_client.get("/admin/streams/stream/")
    assert listing.status_code == 200
    links = re.findall(r'href="\?content_type=[^"]*"', listing.text)
    assert 0 < len(links) <= 200, len(links)
    one = admin_client.get(
        "/admin/streams/stream/", params={"content_type": f"text/plain; variant=v{stamp}-7"}
    )
    assert f"admin/types-{stamp}/7<" in one.text and f"admin/types-{stamp}/8<" not in one.text


def test_actions_refuse_a_selection_that_names_no_object(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    """An action posted with an id that is not one (``x``, a NUL) was a 500
    with a traceback (probe 7d): Django passes the ids to the query as they come. It is
    refused with a message, and nothing changes; a real id still works."""
    for url, action, not_ids in (
        ("/admin/streams/stream/", "delete_streams", ("x", "1\x00")),
        ("/admin/subscriptions/subscription/", "pause", ("x", "1\x00")),
        ("/admin/state/statestream/", "compact_now", ("x", "1\x00")),
        ("/admin/access/apikey/", "delete_selected", ("k\x00",)),  # its ids are text
        ("/admin/auth/user/", "delete_selected", ("x", "1\x00")),  # Django's own admins
        ("/admin/auth/group/", "delete_selected", ("x", "1\x00")),
    ):
        listing = admin_client.get(url)
        assert listing.status_code == 200, url
        for bad in not_ids:
            refused = run_action(admin_client, listing, action, bad)
            assert refused.status_code == 200, (url, bad, refused.status_code)
            assert '<li class="error">No ' in refused.text, (url, bad)
        # Out of range: Django's query finds nothing.
        assert run_action(admin_client, listing, action, "9" * 20).status_code == 200, url
    path = f"admin/action-{time.time_ns()}"
    client.put(f"/v1/stream/{path}", headers=TEXT)
    listing = admin_client.get("/admin/streams/stream/", params={"q": path})
    stream_id = re.search(r'href="/admin/streams/stream/(\d+)/change/', listing.text)
    assert stream_id is not None
    assert run_action(admin_client, listing, "delete_streams", stream_id.group(1)).is_success
    assert client.head(f"/v1/stream/{path}").status_code == 404


def test_a_long_message_is_previewed_from_its_head(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    """The messages page reads a message's first 64 KiB: a JSON message of 200,009 bytes of
    "é" cut inside a character was shown as hex, with a count of the bytes left out of the
    head rather than of the message (found by review). It is text, and the count is the
    message's."""
    path = f"admin/head-{time.time_ns()}"
    client.put(f"/v1/stream/{path}", headers={"Content-Type": "application/json"})
    message = json.dumps({"v": "é" * 100_000}, ensure_ascii=False).encode()
    assert len(message) == 200_009
    appended = client.post(
        f"/v1/stream/{path}", headers={"Content-Type": "application/json"}, content=message
    )
    assert appended.status_code == 204
    listing = admin_client.get("/admin/streams/stream/", params={"q": path})
    stream_id = re.search(r'href="/admin/streams/stream/(\d+)/change/', listing.text)
    assert stream_id is not None
    page = admin_client.get(f"/admin/streams/stream/{stream_id.group(1)}/messages/")
    assert "éééé" in page.text
    left_out = re.search(r"é … \(\+(\d+) bytes\)", page.text)
    assert left_out is not None  # text, not hex
    # What the preview leaves out of the message, not of the 64 KiB read of it.
    assert int(left_out.group(1)) > len(message) - 2 * PREVIEW_CHARS - 16
