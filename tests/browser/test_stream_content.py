"""What a stream holds is a client's data, served on the server's own origin: opened in a
browser (a signed read URL needs no header, so a link is enough), an HTML or SVG stream must not
run its scripts there, where the admin's and console's session cookie lives (PROTOCOL.md 12.7;
streams.http.responses.SECURITY_HEADERS: ``Content-Security-Policy: sandbox``).

Found by an adversarial probe: a key allowed to write one stream stored a script in a
``text/html`` stream, and a staff user who opened its signed URL ran it with their session; it
read the admin's list of API keys.
"""

from __future__ import annotations

import time

import httpx
import pytest
from playwright.sync_api import Page

from tests.browser.conftest import PageErrors
from tests.conftest import ServerProcess

# Sets the title from the page's own origin, with what only a same-origin script could read.
SCRIPT = (
    "fetch('/admin/').then(r => r.text())"
    ".then(t => { document.title = 'ran: ' + (t.includes('Log out') ? 'as staff' : 'anon') })"
)
BODIES = {
    "text/html": f"<!doctype html><title>data</title><script>{SCRIPT}</script><p>hello</p>",
    "image/svg+xml": (
        '<svg xmlns="http://www.w3.org/2000/svg"><title>data</title>'
        f"<script>{SCRIPT}</script></svg>"
    ),
}


@pytest.mark.parametrize("content_type", sorted(BODIES))
def test_a_stream_opened_in_a_browser_runs_no_script(
    page: Page,
    page_errors: PageErrors,
    api: httpx.Client,
    keys_server: ServerProcess,
    content_type: str,
) -> None:
    path = f"browser/content-{time.time_ns()}"
    stream = f"/v1/stream/{path}"
    headers = {"Content-Type": content_type}
    assert api.put(stream, headers=headers).status_code == 201
    assert api.post(stream, headers=headers, content=BODIES[content_type]).is_success
    minted = api.post("/v1/auth/signed-urls", json={"stream": path, "expires_in": 60})
    assert minted.status_code == 201, minted.text
    # The browser reports the scripts it refused to run; that is what this test expects.
    page_errors.allow("sandboxed")
    page_errors.allow("Content Security Policy")
    response = page.goto(minted.json()["url"] + "&offset=-1")
    assert response is not None and response.status == 200
    # A script that runs sets the title within one round trip to /admin/; give it ten.
    page.wait_for_timeout(500)
    assert not page.title().startswith("ran"), page.title()
    assert "sandbox" in (response.headers.get("content-security-policy") or "")
