"""Webhook URLs are refused when they could reach the server's own network (PROTOCOL.md 6.2,
12.8): a production server (no loopback exception) refuses http://, and every address class
named by the protocol, written as an address, as a name, or behind a name that resolves to
one. That an accepted URL is checked again at each delivery is tested with servers of their own
(tests/subscriptions/test_processes.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.subscriptions.support import CONTROL, put_subscription

# (address class, URL): each must be refused with 400 WEBHOOK_URL_REJECTED.
REFUSED = [
    ("plain http", "http://example.com/hook"),
    ("plain http to an address", "http://93.184.216.34/hook"),
    ("not http at all", "ftp://example.com/hook"),
    ("no host", "https:///hook"),
    ("credentials", "https://user:pass@example.com/hook"),
    ("RFC 1918 10/8", "https://10.0.0.1/hook"),
    ("RFC 1918 172.16/12", "https://172.16.5.4/hook"),
    ("RFC 1918 192.168/16", "https://192.168.1.1:8443/hook"),
    ("IPv6 unique local", "https://[fd12:3456::1]/hook"),
    ("IPv4-mapped private", "https://[::ffff:10.0.0.1]/hook"),
    ("link-local", "https://169.254.10.20/hook"),
    ("IPv6 link-local", "https://[fe80::1]/hook"),
    ("loopback", "https://127.0.0.1/hook"),
    ("loopback elsewhere in 127/8", "https://127.1.2.3/hook"),
    ("loopback name", "https://localhost/hook"),
    ("loopback name, trailing dot", "https://localhost./hook"),
    ("IPv6 loopback", "https://[::1]/hook"),
    ("loopback in decimal notation", "https://2130706433/hook"),
    ("metadata address", "https://169.254.169.254/latest/meta-data/"),
    ("metadata IPv6 address", "https://[fd00:ec2::254]/hook"),
    ("metadata name", "https://metadata.google.internal/computeMetadata/v1/"),
    ("unspecified", "https://0.0.0.0/hook"),
    ("shared address space", "https://100.64.0.1/hook"),
    ("multicast", "https://224.0.0.1/hook"),
    ("not a URL", "https://[::1/hook"),
    # A 500 before (probe 9c): the resolver could not encode the name.
    ("empty label", "https://a..b/hook"),
    ("label past 63 characters", f"https://{'a' * 64}.example.com/hook"),
]


@pytest.fixture(scope="module")
def production(start_server: Any) -> Iterator[httpx.Client]:
    """A server as production runs it: no loopback exception for webhooks. Stopped after the
    module: it would refuse to deliver the loopback webhooks of later tests' subscriptions
    (every server of a database takes part in delivering its wakes)."""
    server = start_server(env={"DS_SUBSCRIPTIONS__ALLOW_LOOPBACK_WEBHOOKS": None})
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client
    server.stop()


def _webhook(client: httpx.Client, sub: str, url: str) -> httpx.Response:
    return put_subscription(client, sub, type="webhook", pattern="ssrf/*", webhook={"url": url})


@pytest.mark.parametrize(("case", "url"), REFUSED, ids=[case for case, _ in REFUSED])
def test_refused_address_classes(production: httpx.Client, case: str, url: str) -> None:
    sub = f"ssrf-{time.time_ns()}"
    response = _webhook(production, sub, url)
    assert response.status_code == 400, (case, response.text)
    assert response.json()["error"]["code"] == "WEBHOOK_URL_REJECTED"
    assert production.get(f"{CONTROL}/subscriptions/{sub}").status_code == 404


def test_a_name_resolving_to_a_refused_address_is_refused(production: httpx.Client) -> None:
    """Checked after DNS resolution too: this machine's host name is not a loopback name, but
    it resolves to a loopback address (the test checks that first)."""
    name = socket.gethostname()
    resolved = {info[4][0] for info in socket.getaddrinfo(name, 443, type=socket.SOCK_STREAM)}
    assert name not in ("localhost",) and all(a.startswith("127.") or a == "::1" for a in resolved)
    response = _webhook(production, f"ssrf-{time.time_ns()}", f"https://{name}/hook")
    assert response.status_code == 400
    body = response.json()["error"]
    assert body["code"] == "WEBHOOK_URL_REJECTED" and "resolves to a loopback" in body["message"]


def test_public_https_urls_are_accepted(production: httpx.Client) -> None:
    """A public address, and a name that does not resolve here (it is resolved and checked
    again at each delivery)."""
    for url in ("https://93.184.216.34/hook", "https://hooks.example.com/hook"):
        response = _webhook(production, f"ssrf-{time.time_ns()}", url)
        assert response.status_code == 201, response.text


def test_loopback_only_under_the_development_setting(client: httpx.Client) -> None:
    """The test servers allow loopback receivers (DS_SUBSCRIPTIONS__ALLOW_LOOPBACK_WEBHOOKS):
    http://127.0.0.1 and http://localhost are accepted, private and metadata still refused."""
    for url in ("http://127.0.0.1:9/hook", "http://localhost:9/hook", "https://[::1]:9/hook"):
        assert _webhook(client, f"dev-{time.time_ns()}", url).status_code == 201, url
    for url in ("http://10.0.0.1/hook", "https://169.254.169.254/", "http://example.com/"):
        response = _webhook(client, f"dev-{time.time_ns()}", url)
        assert response.status_code == 400, url
        assert response.json()["error"]["code"] == "WEBHOOK_URL_REJECTED"
