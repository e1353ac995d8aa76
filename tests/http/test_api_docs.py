"""The API documentation pages (``/v1/schema``, ``/v1/docs``) answer every method without a
server error, served by the real server."""

from __future__ import annotations

import httpx


def test_options_on_the_swagger_page(client: httpx.Client) -> None:
    """OPTIONS /v1/docs (a CORS preflight, a crawler; found by tests/fuzz) answered 500: DRF
    answers OPTIONS with the view's metadata, which the page's only renderer, an HTML template
    renderer, cannot render. It answers as Django's pages do: 200, Allow, no body."""
    response = client.options("/v1/docs")
    assert response.status_code == 200, response.text[:300]
    assert {"GET", "HEAD", "OPTIONS"} <= {m.strip() for m in response.headers["Allow"].split(",")}
    assert response.content == b""
    assert client.get("/v1/docs").status_code == 200
    assert client.post("/v1/docs").status_code == 405


def test_options_on_the_schema(client: httpx.Client) -> None:
    assert client.options("/v1/schema").status_code == 200
