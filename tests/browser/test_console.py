"""The stream console in a real browser: a staff user logs in, watches streams appear and go,
follows a stream's messages live (pause, resume, older ones, offsets, the append form), a state
stream's entities and a Yjs document's text change, and the overview's figures. The server
runs with API keys required, so every live view goes through a signed read URL."""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
from playwright.sync_api import Browser, Page, expect

from tests.browser.conftest import PageErrors
from tests.browser.support import log_in, screenshot, wait_until
from tests.conftest import ServerProcess
from tests.state.support import change
from tests.yjs.support import Writer, frames, unique

JSON = {"Content-Type": "application/json"}
TEXT = {"Content-Type": "text/plain"}
BINARY = {"Content-Type": "application/octet-stream"}


def console_url(server: ServerProcess, kind: str, path: str) -> str:
    return f"{server.base_url}/console/{kind}/{quote(path, safe='/')}"


def open_stream(page: Page, server: ServerProcess, path: str) -> None:
    page.goto(console_url(server, "stream", path))
    expect(page.locator("#live-status")).to_have_attribute("data-status", "live")


def messages(page: Page):
    return page.locator("#messages > li.message")


def test_an_anonymous_visitor_is_sent_to_log_in(
    browser: Browser, keys_server: ServerProcess, staff: str
) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{keys_server.base_url}/console/streams/")
    assert page.url.startswith(f"{keys_server.base_url}/admin/login/")
    assert "next=/console/streams/" in page.url
    expect(page.locator("#id_username")).to_be_visible()
    log_in(page, keys_server.base_url, staff, next_path="/console/streams/")
    expect(page.locator("h1")).to_contain_text("Streams")
    context.close()


def test_the_list_shows_streams_appear_and_go_live(
    page: Page, keys_server: ServerProcess, api: httpx.Client
) -> None:
    prefix = f"{unique('list')}/"
    page.goto(f"{keys_server.base_url}/console/streams/?path_prefix={quote(prefix)}")
    expect(page.locator("#live-status")).to_have_attribute("data-status", "live")
    expect(page.locator("td.empty")).to_be_visible()

    assert api.put(f"/v1/stream/{prefix}events", headers=JSON).status_code == 201
    assert api.put(f"/v1/stream/{prefix}blob", headers=BINARY, content=b"\x00").status_code == 201
    row = page.locator(f'tr[data-path="{prefix}events"]')
    expect(row).to_be_visible(timeout=5000)
    expect(page.locator(f'tr[data-path="{prefix}blob"]')).to_be_visible(timeout=5000)
    expect(row).to_contain_text("application/json")
    screenshot(page, "streams")

    assert api.delete(f"/v1/stream/{prefix}events").status_code == 204
    expect(row).to_have_count(0, timeout=5000)
    expect(page.locator(f'tr[data-path="{prefix}blob"]')).to_be_visible()


def test_the_list_searches(
    page: Page, keys_server: ServerProcess, api: httpx.Client, page_errors: PageErrors
) -> None:
    prefix = f"{unique('search')}/"
    api.put(f"/v1/stream/{prefix}small", headers=TEXT, content=b"hi")
    api.put(f"/v1/stream/{prefix}large", headers=TEXT, content=b"x" * 5000)
    api.put(f"/v1/stream/{prefix}closed", headers=TEXT | {"Stream-Closed": "true"})
    api.put(f"/v1/stream/{prefix}fork", headers={"Stream-Forked-From": f"{prefix}large"})
    base = f"{keys_server.base_url}/console/streams/?path_prefix={quote(prefix)}"

    def listed(query: str) -> set[str]:
        page.goto(f"{base}&{query}")
        rows = page.locator("tr[data-path]")
        return {rows.nth(i).get_attribute("data-path") or "" for i in range(rows.count())}

    every = {f"{prefix}{name}" for name in ("small", "large", "closed", "fork")}
    assert listed("") == every
    assert listed("min_bytes=1000") == {f"{prefix}large", f"{prefix}fork"}
    assert listed("closed=yes") == {f"{prefix}closed"}
    assert listed("fork=fork") == {f"{prefix}fork"}
    assert listed(f"forked_from={quote(prefix)}large") == {f"{prefix}fork"}
    assert listed("content_type=application/json") == set()
    assert listed("tail_from=0000000000000001_0000000000000100") == {
        f"{prefix}large",
        f"{prefix}fork",
    }
    page_errors.allow("400 (Bad Request)")
    page.goto(f"{base}&min_bytes=-5")
    expect(page.locator("form.filters .problem")).to_contain_text("greater than or equal to 0")


def test_a_stream_tails_live_pauses_and_resumes(
    page: Page, keys_server: ServerProcess, api: httpx.Client
) -> None:
    path = unique("tail")
    api.put(f"/v1/stream/{path}", headers=JSON, content=b'[{"first": 1}]')
    open_stream(page, keys_server, path)
    expect(messages(page)).to_have_count(1)

    # Appended through the API, shown live (no reload), pretty-printed. How fast is for
    # benchmarks (make test-browser-load), not for an assertion on a loaded machine.
    api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps({"n": 2, "tags": ["a"]}))
    shown = messages(page).filter(has_text='"n": 2')
    shown.wait_for(timeout=5000)
    body = shown.locator("pre.body").inner_text()
    assert body == '{\n  "n": 2,\n  "tags": [\n    "a"\n  ]\n}', body

    page.click("#pause")
    expect(page.locator("#live-status")).to_have_attribute("data-status", "paused")
    api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps({"n": 3}))
    page.wait_for_timeout(1000)
    expect(messages(page).filter(has_text='"n": 3')).to_have_count(0)
    page.click("#pause")  # now "Resume"
    expect(messages(page).filter(has_text='"n": 3')).to_have_count(1, timeout=5000)
    expect(page.locator("#live-status")).to_have_attribute("data-status", "live")
    expect(messages(page)).to_have_count(3)
    expect(page.locator("#tail-offset")).to_have_text(
        api.head(f"/v1/stream/{path}").headers["Stream-Next-Offset"]
    )
    screenshot(page, "stream")

    # Copy an offset: the third message's, as the server would read from it.
    third = messages(page).nth(2)
    offset = third.get_attribute("data-offset")
    third.locator("button.copy").click()
    expect(third.locator("button.copy")).to_have_text("copied")
    assert page.evaluate("navigator.clipboard.readText()") == offset
    read = api.get(f"/v1/stream/{path}", params={"offset": offset})
    assert read.json() == [{"n": 3}]


def test_a_page_whose_offset_is_trimmed_away_follows_on(
    page: Page, keys_server: ServerProcess, api: httpx.Client, page_errors: PageErrors
) -> None:
    """Review: an EventSource cannot see its answer's status, so a page whose offset had been
    trimmed away (paused while its stream was appended to and trimmed) retried it for ever,
    "reconnecting". The 410 is found by a catch-up read after the second failure: the page
    says so and follows from the tail."""
    page_errors.allow("410")
    path = unique("trimmed")
    api.put(f"/v1/stream/{path}", headers=JSON, content=b'[{"first": 1}]')
    open_stream(page, keys_server, path)
    expect(messages(page)).to_have_count(1)
    page.click("#pause")
    expect(page.locator("#live-status")).to_have_attribute("data-status", "paused")
    api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps({"n": 2}))
    trimmed = api.post(f"/v1/stream/{path}", headers={"Stream-Trim-Before": "now"})
    assert trimmed.is_success, trimmed.text
    page.click("#pause")  # now "Resume"
    notice = page.locator("#messages-notice")
    expect(notice).to_contain_text("trimmed or compacted away", timeout=15_000)
    expect(page.locator("#live-status")).to_have_attribute("data-status", "live")
    api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps({"n": 3}))
    expect(messages(page).filter(has_text='"n": 3')).to_have_count(1, timeout=5000)


def test_binary_messages_show_as_hex_with_their_length(
    page: Page, keys_server: ServerProcess, api: httpx.Client
) -> None:
    path = unique("binary")
    api.put(f"/v1/stream/{path}", headers=BINARY)
    open_stream(page, keys_server, path)
    api.post(f"/v1/stream/{path}", headers=BINARY, content=bytes([0, 1, 0x7F, 0xFF]) * 5)
    message = messages(page).first
    expect(message.locator("pre.hex")).to_have_text(
        "00 01 7f ff 00 01 7f ff 00 01 7f ff 00 01 7f ff\n00 01 7f ff"
    )
    expect(message.locator(".size")).to_have_text("20 bytes")


def test_text_appended_from_the_form_and_refusals(
    page: Page, keys_server: ServerProcess, api: httpx.Client, page_errors: PageErrors
) -> None:
    page_errors.allow("400 (Bad Request)")
    path = unique("form")
    api.put(f"/v1/stream/{path}", headers=TEXT)
    open_stream(page, keys_server, path)
    page.fill("#id_body", "hello from the form\nsecond line")
    page.click("#append-form button[type=submit]")
    expect(page.locator("#append-result")).to_contain_text("Appended")
    expect(messages(page).locator("pre.body")).to_have_text("hello from the form\nsecond line")
    assert api.get(f"/v1/stream/{path}", params={"offset": "-1"}).text == (
        "hello from the form\nsecond line"
    )

    json_path = unique("form-json")
    api.put(f"/v1/stream/{json_path}", headers=JSON)
    open_stream(page, keys_server, json_path)
    page.fill("#id_body", '{"not json"')
    page.click("#append-form button[type=submit]")
    expect(page.locator("#append-result")).to_contain_text("Not appended (400)")
    expect(page.locator("#append-result")).to_contain_text("invalid JSON")
    assert (
        api.head(f"/v1/stream/{json_path}")
        .headers["Stream-Next-Offset"]
        .startswith("0000000000000000_")
    )
    page.fill("#id_body", '[{"a": 1}, {"b": 2}]')
    page.click("#append-form button[type=submit]")
    expect(messages(page)).to_have_count(2)


def test_older_messages_load_by_offset(
    page: Page, keys_server: ServerProcess, api: httpx.Client, page_errors: PageErrors
) -> None:
    page_errors.allow("400 (Bad Request)")
    path = unique("older")
    api.put(f"/v1/stream/{path}", headers=JSON)
    api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps([{"i": i} for i in range(120)]))
    open_stream(page, keys_server, path)
    expect(messages(page)).to_have_count(50)
    expect(messages(page).first).to_contain_text('"i": 70')
    page.click("#load-older")
    expect(messages(page)).to_have_count(100)
    expect(messages(page).first).to_contain_text('"i": 20')

    # Go to an offset: the 10 messages before it, then everything from it, live.
    offset = messages(page).filter(has_text='"i": 30').first.get_attribute("data-offset")
    assert offset is not None
    page.fill("#goto-offset input[name=offset]", offset)
    page.click("#goto-offset button")
    expect(messages(page)).to_have_count(100)
    expect(messages(page).first).to_contain_text('"i": 20')
    expect(page.locator("#received-count")).to_have_text("90")
    page.fill("#goto-offset input[name=offset]", "0000000000000001_0000000000000001")
    page.click("#goto-offset button")
    expect(page.locator("#messages-notice")).to_contain_text("not an offset of this stream")


def test_a_state_streams_entities_change_live(
    page: Page, keys_server: ServerProcess, api: httpx.Client
) -> None:
    path = unique("state")
    api.put(f"/v1/stream/{path}", headers=JSON)
    registered = api.post("/v1/state/streams", json={"stream": path, "schemas": {}})
    assert registered.status_code == 201, registered.text
    page.goto(console_url(keys_server, "state", path))
    expect(page.locator("#live-status")).to_have_attribute("data-status", "live")
    expect(page.locator("#live-fragment .empty")).to_be_visible()

    ada = [change("user", "u1", {"name": "Ada"}), change("room", "r1", {"topic": "math"})]
    api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps(ada))
    user = page.locator('section[data-type="user"] tr[data-key="u1"]')
    expect(user).to_contain_text('"name": "Ada"', timeout=5000)
    expect(page.locator('section[data-type="room"] tr[data-key="r1"]')).to_contain_text("math")

    grace = [change("user", "u1", {"name": "Grace"}, op="update")]
    api.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps(grace))
    expect(user).to_contain_text('"name": "Grace"', timeout=5000)
    screenshot(page, "state")
    api.post(
        f"/v1/stream/{path}", headers=JSON, content=json.dumps([change("user", "u1", op="delete")])
    )
    expect(user).to_have_count(0, timeout=5000)


def test_a_yjs_documents_text_changes_live(
    page: Page, keys_server: ServerProcess, api: httpx.Client
) -> None:
    doc = unique("notes")
    url = f"/v1/yjs/console/docs/{doc}"
    assert api.put(url).status_code == 201
    writer = Writer()
    assert api.post(url, headers=BINARY, content=frames(writer.edit("Hello"))).status_code == 204
    # The list shows the document's updates stream, with a link to the document.
    updates = f"__ds/yjs/console/docs/{doc}"
    page.goto(f"{keys_server.base_url}/console/streams/?path_prefix={quote(updates)}")
    page.click(f'tr[data-path="{updates}"] a:text("Yjs document")')
    page.wait_for_url(f"{keys_server.base_url}/console/yjs/console/{doc}")
    expect(page.locator("#live-status")).to_have_attribute("data-status", "live")
    root = page.locator('pre.doc-root[data-root="content (Text)"]')
    expect(root).to_have_text("Hello")

    api.post(url, headers=BINARY, content=frames(writer.edit(", world")))
    expect(root).to_have_text("Hello, world", timeout=5000)
    expect(page.locator("#live-fragment")).to_contain_text("2 updates")
    screenshot(page, "yjs")

    # Its updates stream follows through /v1/yjs/ (/v1/stream/ refuses internal paths).
    page.click("text=its updates stream")
    expect(page.locator("#live-status")).to_have_attribute("data-status", "live")
    expect(messages(page)).to_have_count(2)
    api.post(url, headers=BINARY, content=frames(writer.edit("!")))
    expect(messages(page)).to_have_count(3, timeout=5000)
    expect(messages(page).last.locator("pre.hex")).to_be_visible()


def test_the_overview_shows_the_server_now(
    page: Page, keys_server: ServerProcess, api: httpx.Client
) -> None:
    path = unique("overview")
    api.put(f"/v1/stream/{path}", headers=TEXT)
    page.goto(f"{keys_server.base_url}/console/")
    for i in range(20):
        api.post(f"/v1/stream/{path}", headers=TEXT, content=f"{i}")
    rate = page.locator('[data-figure="appends_per_second"]')
    wait_until(lambda: _number(rate.inner_text()) > 0, timeout=15)
    expect(page.locator("#appends-chart canvas")).to_have_count(1)
    streams = _number(page.locator('[data-figure="streams"]').inner_text())
    assert streams >= 1
    screenshot(page, "overview")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return -1


def test_user_content_is_shown_as_text_never_run(
    page: Page, keys_server: ServerProcess, api: httpx.Client
) -> None:
    """Stream paths and message contents are the users' own: the console shows them as text,
    and its Content-Security-Policy would stop a script even if an escape were missed."""
    attack = "<img src=x onerror=window.__xss=1>"
    path = f"{unique('xss')}/{attack}"
    assert api.put(f"/v1/stream/{quote(path)}", headers=TEXT).status_code == 201
    api.post(
        f"/v1/stream/{quote(path)}",
        headers=TEXT,
        content=f"<script>window.__xss=2</script>{attack}",
    )
    json_path = unique("xss-json")
    api.put(f"/v1/stream/{json_path}", headers=JSON)
    api.post(f"/v1/stream/{json_path}", headers=JSON, content=json.dumps({attack: attack}))

    page.goto(f"{keys_server.base_url}/console/streams/?path_prefix={quote(path)}")
    expect(page.locator("td.path a")).to_have_text(path)
    open_stream(page, keys_server, path)
    expect(page.locator("h1.path")).to_have_text(path)
    expect(messages(page).locator("pre.body")).to_contain_text("<script>window.__xss=2</script>")
    open_stream(page, keys_server, json_path)
    expect(messages(page).locator("pre.body")).to_contain_text(attack)
    assert page.locator("img").count() == 0
    assert page.evaluate("window.__xss") is None
