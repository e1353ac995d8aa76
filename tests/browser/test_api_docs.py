"""The API documentation page in a real browser, on a machine without internet access."""

from __future__ import annotations

from playwright.sync_api import Page, Route, expect

from tests.browser.support import screenshot
from tests.conftest import ServerProcess


def test_the_api_docs_render_without_the_internet(page: Page, keys_server: ServerProcess) -> None:
    """/v1/docs loaded Swagger UI from a CDN: on a machine without internet access the page
    stayed blank. Every asset now comes from the server itself."""
    elsewhere: list[str] = []
    origin = keys_server.base_url

    def only_this_server(route: Route) -> None:
        if route.request.url.startswith(origin):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", only_this_server)
    page.goto(f"{origin}/v1/docs")
    expect(page.locator(".swagger-ui .opblock").first).to_be_visible(timeout=10_000)
    expect(page.locator(".swagger-ui")).to_contain_text("/v1/streams")
    assert elsewhere == []
    screenshot(page, "api-docs")
