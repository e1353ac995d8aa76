"""Webhook URL validation against server-side request forgery (PROTOCOL.md 6.2, 12.8).

A webhook URL must be ``https://`` to a host whose every address is globally routable: no
loopback, RFC 1918 private, link-local (cloud metadata services live at 169.254.169.254),
shared (100.64/10), unique-local, multicast, reserved or unspecified address, in any notation
(IPv4-mapped IPv6 included). The host is checked as written, when the subscription is created,
and again after DNS resolution: at creation and at every delivery, where the connection goes
only to the addresses checked (``SafeResolver``), so a name that later resolves elsewhere (DNS
rebinding) reaches nothing it should not.

The one exception is for development, and only when ``DS_SUBSCRIPTIONS__ALLOW_LOOPBACK_WEBHOOKS``
is set: ``http://`` or ``https://`` to ``localhost``, 127.0.0.0/8 or ``::1``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from subscriptions.protocol import SubscriptionError

# Names of cloud metadata services, refused by name before any resolution.
METADATA_HOSTS = frozenset(
    {"metadata", "metadata.google.internal", "metadata.goog", "instance-data", "metadata.azure"}
)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def rejected(message: str) -> SubscriptionError:
    return SubscriptionError(400, "WEBHOOK_URL_REJECTED", message)


def address_class(address: IPAddress) -> str | None:
    """What makes ``address`` a forbidden target (a short name for messages), or None when it
    is a public address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address_class(address.ipv4_mapped)
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local (cloud metadata)" if _is_metadata(address) else "link-local"
    if _is_metadata(address):
        return "cloud metadata"
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return "shared (carrier-grade NAT)"
    if address.is_reserved:
        return "reserved"
    if address.is_private:
        return "private"
    if not address.is_global:
        return "reserved"
    return None


_SHARED = ipaddress.ip_network("100.64.0.0/10")
_METADATA = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)


def _is_metadata(address: IPAddress) -> bool:
    return address in _METADATA


@dataclass(frozen=True, slots=True)
class WebhookTarget:
    url: str
    scheme: str
    host: str
    port: int
    # The host is a loopback name or address, allowed by the development setting.
    loopback: bool


def check_url(url: str, *, allow_loopback: bool) -> WebhookTarget:
    """Check the URL as written; raises ``WEBHOOK_URL_REJECTED``. Names are resolved and
    checked separately (``check_resolved``)."""
    try:
        parts: SplitResult = urlsplit(url)
        port = parts.port
    except ValueError:
        raise rejected("webhook.url is not a valid URL") from None
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".").lower()
    if scheme not in ("http", "https") or not host:
        raise rejected("webhook.url must be an https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise rejected("webhook.url must not carry credentials")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise rejected("webhook.url contains spaces or control characters")
    try:
        # What name resolution encodes the host as: an empty label (a..b) or one longer than 63
        # characters is no host name (the resolver's UnicodeError was a 500: probe 9c).
        host.encode("idna")
    except UnicodeError:
        raise rejected(f"webhook.url's host is not a valid host name ({host[:100]})") from None
    loopback = _is_loopback_host(host)
    if loopback and allow_loopback:
        return WebhookTarget(url, scheme, host, port or _default_port(scheme), loopback=True)
    if scheme != "https":
        raise rejected(
            "webhook.url must use https://"
            + ("" if allow_loopback else " (http:// only to localhost, in development)")
        )
    if host in METADATA_HOSTS:
        raise rejected(f"webhook.url targets a cloud metadata service ({host})")
    address = _literal_address(host)
    if address is not None:
        forbidden = address_class(address)
        if forbidden is not None:
            raise rejected(f"webhook.url targets a {forbidden} address ({host})")
    elif loopback:
        raise rejected(f"webhook.url targets a loopback host ({host})")
    return WebhookTarget(url, scheme, host, port or _default_port(scheme), loopback=False)


def check_resolved(target: WebhookTarget, addresses: list[str]) -> list[str]:
    """The addresses a name resolved to, all of which must be allowed (one forbidden address
    refuses the URL: a client could otherwise pick it)."""
    if not addresses:
        raise rejected(f"webhook.url's host {target.host} has no address")
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])
        forbidden = address_class(address)
        if forbidden is None:
            continue
        if target.loopback and address_class(address) == "loopback":
            continue
        raise rejected(f"webhook.url's host {target.host} resolves to a {forbidden} address")
    return addresses


async def resolve(target: WebhookTarget) -> list[str]:
    """The host's addresses (it may be an address already); raises ``OSError`` when it does
    not resolve."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def validate(url: str, *, allow_loopback: bool) -> WebhookTarget:
    """Everything a new subscription's URL must pass. A name that does not resolve now is
    accepted (it is resolved and checked again at every delivery)."""
    target = check_url(url, allow_loopback=allow_loopback)
    try:
        addresses = await resolve(target)
    except OSError:
        return target
    check_resolved(target, addresses)
    return target


class SafeResolver:
    """An aiohttp resolver that resolves like the system does, then refuses a host if any of
    its addresses is forbidden: the connection can only go to addresses that were checked."""

    def __init__(self, *, allow_loopback: bool) -> None:
        self._allow_loopback = allow_loopback

    async def resolve(
        self, host: str, port: int = 0, family: int = socket.AF_INET
    ) -> list[dict[str, Any]]:
        target = check_url(
            f"https://{_bracketed(host)}:{port or 443}/", allow_loopback=self._allow_loopback
        )
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=family)
        check_resolved(target, [str(info[4][0]) for info in infos])
        return [
            {
                "hostname": host,
                "host": str(info[4][0]),
                "port": port,
                "family": info[0],
                "proto": info[2],
                "flags": socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
            }
            for info in infos
        ]

    async def close(self) -> None:
        return None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _literal_address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _is_loopback_host(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    address = _literal_address(host)
    if address is None:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80
