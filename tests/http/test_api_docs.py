"""The API documentation pages (``/v1/schema``, ``/v1/docs``) answer every method without a
server error, served by the real server."""

from __future__ import annotations

import asyncio
from typing import Any

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


def test_the_schema_asked_for_by_many_at_once(start_server: Any) -> None:
    """Twenty requests for the schema at once, on a server that has not built it yet, all get
    it (drf-spectacular's generator keeps its state in globals: built by several threads at
    once it answered 500s, "Schema generation REQUIRES a view instance"), and it is the same
    schema for each; asked for as YAML it comes as YAML."""
    server = start_server()

    async def ask_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.gather(*(client.get("/v1/schema") for _ in range(20)))

    answers = asyncio.run(ask_all())
    assert [answer.status_code for answer in answers] == [200] * 20, [
        answer.text[:200] for answer in answers if answer.status_code != 200
    ]
    assert len({answer.content for answer in answers}) == 1
    assert "/v1/streams" in answers[0].text
    yaml = httpx.get(f"{server.base_url}/v1/schema", params={"format": "yaml"})
    assert yaml.status_code == 200 and yaml.text.startswith("openapi:")
    assert ".yaml" in yaml.headers["Content-Disposition"]


def test_the_schema_has_one_version(client: httpx.Client) -> None:
    """Probe 10e: ``?version=`` went into the answer's Content-Disposition and built a schema
    of its own. A line break in it was a 500 (with a traceback) for anyone, U+2028 a connection
    closed without an answer, a quote let the client name the file a browser saves. The API
    has one version: the parameter is refused, whatever it says."""
    for version in ("a\nb", "\u2028", "x\"; filename*=UTF-8''evil.html; x=\"", "2"):
        response = client.get("/v1/schema", params={"version": version})
        assert response.status_code == 400, (version, response.text[:200])
        assert "one version" in response.json()["detail"]
        assert "evil" not in response.headers.get("Content-Disposition", "")
    plain = client.get("/v1/schema", params={"format": "json"})
    assert plain.status_code == 200
    assert plain.headers["Content-Disposition"].endswith('.json"')
    schema = plain.json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "/v1/schema" not in schema["paths"]  # review: the view's own get published itself
