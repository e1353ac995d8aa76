"""The pure rules of subscriptions (subscriptions.protocol, .ssrf, .signing), without a
database or a server (PROTOCOL.md 6.2, 7, 12.8-12.10)."""

from __future__ import annotations

import asyncio
import base64
import socket
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from subscriptions import signing
from subscriptions.protocol import (
    SubscriptionError,
    glob_matches,
    glob_prefix,
    parse_config,
    parse_wake_report,
)
from subscriptions.ssrf import SafeResolver, address_class, check_url

GLOBS = [
    # pattern, path, matches
    ("events/*", "events/a", True),
    ("events/*", "events/a/b", False),
    ("events/*", "events", False),
    ("events/**", "events", True),
    ("events/**", "events/a/b/c", True),
    ("events/**", "eventsx/a", False),
    ("**", "anything/at/all", True),
    ("**/x", "x", True),
    ("**/x", "a/b/x", True),
    ("**/x", "a/b/y", False),
    ("a/**/b", "a/b", True),
    ("a/**/b", "a/1/2/b", True),
    ("a/*/c", "a/b/c", True),
    ("a/*/c", "a//c", False),
    ("a.b/*", "a.b/x", True),
    ("a.b/*", "aXb/x", False),
    ("(x)/[y]/$", "(x)/[y]/$", True),
    ("café/*", "café/x", True),
]


@pytest.mark.parametrize(("pattern", "path", "matches"), GLOBS)
def test_globs(pattern: str, path: str, matches: bool) -> None:
    assert glob_matches(pattern, path) is matches


def test_glob_prefix_is_what_every_match_starts_with() -> None:
    assert glob_prefix("events/*") == "events/"
    assert glob_prefix("events/a/**/x") == "events/a/"
    assert glob_prefix("**") == ""
    assert glob_prefix("exact/path") == "exact/path"


def test_the_configuration_hash_normalizes() -> None:
    base = {"type": "webhook", "pattern": "/a/*/", "webhook": {"url": "https://h.example/x"}}
    one = parse_config(base | {"streams": ["s/2", "s/1", "s/2"]})
    two = parse_config(base | {"pattern": "a/*", "streams": ["s/1", "s/2"], "lease_ttl_ms": 30000})
    assert one.config_hash() == two.config_hash()
    assert one.config_hash() != parse_config(base | {"description": "x"}).config_hash()
    assert one.config_hash() != parse_config(base | {"lease_ttl_ms": 1000}).config_hash()


def test_wake_reports() -> None:
    report = parse_wake_report(
        {
            "wake_id": "w_1",
            "generation": 3,
            "acks": [{"stream": "/a/", "offset": "0000000000000001_0000000000000002"}],
            "done": True,
        }
    )
    assert report.acks[0].stream == "a" and report.acks[0].offset.pos == 2 and report.done
    for body in ({"generation": 1}, {"wake_id": "w", "generation": -1},
                 {"wake_id": "w", "generation": True}, {"wake_id": "w", "generation": 1,
                                                        "done": "yes"}):  # fmt: skip
        with pytest.raises(SubscriptionError) as refused:
            parse_wake_report(body)
        assert refused.value.status == 400
    with pytest.raises(SubscriptionError) as bad_offset:
        parse_wake_report({"wake_id": "w", "generation": 1, "acks": [{"stream": "a",
                           "offset": "-1"}]})  # fmt: skip
    assert bad_offset.value.code == "INVALID_OFFSET"


ADDRESSES = [
    ("10.1.2.3", "private"),
    ("172.31.255.255", "private"),
    ("192.168.0.1", "private"),
    ("fd00::1", "private"),
    ("169.254.0.1", "link-local"),
    ("fe80::1", "link-local"),
    ("169.254.169.254", "link-local (cloud metadata)"),
    ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    ("127.0.0.1", "loopback"),
    ("::1", "loopback"),
    ("::ffff:127.0.0.1", "loopback"),
    ("0.0.0.0", "unspecified"),
    ("100.64.1.1", "shared (carrier-grade NAT)"),
    ("224.0.0.251", "multicast"),
    ("240.0.0.1", "reserved"),
    ("93.184.216.34", None),
    ("2606:2800:220:1:248:1893:25c8:1946", None),
]


@pytest.mark.parametrize(("address", "forbidden"), ADDRESSES)
def test_address_classes(address: str, forbidden: str | None) -> None:
    import ipaddress

    assert address_class(ipaddress.ip_address(address)) == forbidden


def test_urls_as_written() -> None:
    assert check_url("https://h.example/x", allow_loopback=False).port == 443
    assert check_url("http://127.0.0.1:8080/x", allow_loopback=True).loopback
    for url in ("http://127.0.0.1/x", "https://localhost/x", "https://[::1]/"):
        with pytest.raises(SubscriptionError):
            check_url(url, allow_loopback=False)
    for url in ("http://10.0.0.1/", "https://169.254.169.254/", "http://h.example/"):
        with pytest.raises(SubscriptionError):
            check_url(url, allow_loopback=True)


def test_the_delivery_resolver_refuses_names_of_forbidden_addresses() -> None:
    """aiohttp connects only to what SafeResolver returns: a name resolving to loopback is
    refused (this machine's host name resolves to 127.0.0.1; checked first), and is fine
    under the development setting only when it is a loopback name."""
    name = socket.gethostname()
    assert all(info[4][0].startswith("127.") for info in socket.getaddrinfo(name, 443))

    async def resolve(host: str, allow: bool) -> list[str]:
        return [
            entry["host"] for entry in await SafeResolver(allow_loopback=allow).resolve(host, 443)
        ]

    with pytest.raises(SubscriptionError):
        asyncio.run(resolve(name, False))
    with pytest.raises(SubscriptionError):
        asyncio.run(resolve(name, True))
    with pytest.raises(SubscriptionError):
        asyncio.run(resolve("localhost", False))
    assert "127.0.0.1" in asyncio.run(resolve("localhost", True))


def test_signatures_verify_with_the_published_key() -> None:
    key = signing.generate_key()
    loaded = signing.load_key(key.kid, key.encrypted_private)
    assert loaded is not None and key.kid.startswith("ds_")
    header = signing.signature_header(loaded, b'{"a":1}', timestamp=1_700_000_000)
    fields = dict(part.split("=", 1) for part in header.split(","))
    assert fields["t"] == "1700000000" and fields["kid"] == key.kid
    public = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(key.public_x + "="))
    public.verify(base64.urlsafe_b64decode(fields["ed25519"] + "=="), b'1700000000.{"a":1}')
    assert key.encrypted_private.find(loaded.private_key.private_bytes_raw()) == -1


def test_tokens_name_one_wake_and_one_use() -> None:
    token = signing.issue_token(sid=7, generation=3, wake_id="w_x", use=signing.CALLBACK)
    claims = signing.verify_token(token, use=signing.CALLBACK)
    assert (claims.sid, claims.generation, claims.wake_id) == (7, 3, "w_x")
    with pytest.raises(SubscriptionError) as wrong_use:
        signing.verify_token(token, use=signing.CLAIM)
    assert wrong_use.value.code == "TOKEN_INVALID"
    claims_of_forgery = {"sid": 7, "gen": 3, "wid": "w_x", "use": "callback"}
    forged = jwt.encode(
        claims_of_forgery | {"exp": int(time.time()) + 60}, "k" * 32, algorithm="HS256"
    )
    with pytest.raises(SubscriptionError):
        signing.verify_token(forged, use=signing.CALLBACK)
    expired = jwt.encode(
        {"sid": 7, "gen": 3, "wid": "w_x", "use": "callback", "exp": int(time.time()) - 10},
        signing._token_key(),
        algorithm="HS256",
    )
    with pytest.raises(SubscriptionError) as late:
        signing.verify_token(expired, use=signing.CALLBACK)
    assert late.value.code == "TOKEN_EXPIRED"
