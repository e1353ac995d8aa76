"""Signed read URLs for the console's live views, minted for the signed-in staff user.

A browser's ``EventSource`` cannot send an ``Authorization`` header, so the console's pages
follow streams through signed read URLs (``access.signing``), as any browser client of the
protocol does. A signed URL names an API key and is honoured only while that key may read
what it covers, so each staff user gets a key of their own, made on first use: read on every
resource (staff see everything in the admin already), owned by the user, never shown to anyone
(only its id is used, to sign). A URL is minted per page for one stream or document, valid for
``SIGNED_URL_SECS``; a page asks for a fresh one through its session when it reconnects.

The key is revoked when its user is deleted. A user who loses staff status or is deactivated
gets no new URLs (the console's views refuse them), and the ones they hold expire.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from django.contrib.auth import get_user_model
from django.db.models import Q
from django.db.models.signals import pre_delete
from django.utils import timezone

from access import signing
from access.grants import Grant, Operation, doc_resource, stream_resource
from access.models import ApiKey
from access.services import create_key
from yjs.paths import INTERNAL_PREFIX as YJS_PREFIX

SIGNED_URL_SECS = 15 * 60
KEY_NAME = "console (signs live views for this user)"


@dataclass(frozen=True)
class LiveUrl:
    """A signed read URL without its ``offset`` and ``live`` parameters, which the page adds,
    and when it expires (Unix seconds)."""

    url: str
    expires: int

    def as_json(self) -> dict[str, Any]:
        return {"url": self.url, "expires": self.expires}


def console_key_id(user: Any) -> str:
    """The id of the user's console key, made on first use."""
    now = timezone.now()
    existing = (
        ApiKey.objects.filter(owner=user, name=KEY_NAME, revoked=False)
        .filter(Q(expiry_date__isnull=True) | Q(expiry_date__gt=now))
        .values_list("prefix", flat=True)
        .first()
    )
    if existing is not None:
        return existing
    key, _plaintext = create_key(
        name=KEY_NAME,
        grants=[Grant("", frozenset({Operation.READ}))],
        owner=user.get_username(),
    )
    return key.prefix


def stream_live_url(user: Any, path: str) -> LiveUrl:
    """A signed URL reading the stream at ``path``: through ``/v1/stream/``, or for the
    internal streams of a Yjs document (which ``/v1/stream/`` refuses), through ``/v1/yjs/``:
    its updates, or one of its awareness streams."""
    if path.startswith(YJS_PREFIX):
        service, _, rest = path[len(YJS_PREFIX) :].partition("/")
        kind, _, rest = rest.partition("/")
        if kind == "docs" and rest:
            return doc_live_url(user, service, rest)
        doc_path, _, name = rest.rpartition("/")
        if kind == "awareness" and doc_path and name:
            signed = doc_live_url(user, service, doc_path)
            return LiveUrl(f"{signed.url}&{urlencode({'awareness': name})}", signed.expires)
    return _signed(user, stream_resource(path), f"/v1/stream/{quote(path, safe='/')}")


def doc_live_url(user: Any, service: str, doc_path: str) -> LiveUrl:
    """A signed URL reading a Yjs document's updates through ``/v1/yjs/``."""
    resource = doc_resource(service, doc_path)
    return _signed(user, resource, f"/v1/yjs/{service}/docs/{quote(doc_path, safe='/')}")


def _signed(user: Any, resource: str, url_path: str) -> LiveUrl:
    expires = int(time.time()) + SIGNED_URL_SECS
    params = signing.sign(console_key_id(user), resource, exact=True, expires=expires)
    return LiveUrl(f"{url_path}?{signing.query_string(params)}", expires)


def _revoke_keys_of(sender: Any, instance: Any, **kwargs: Any) -> None:
    ApiKey.objects.filter(owner=instance, name=KEY_NAME).update(revoked=True)


def revoke_with_their_users() -> None:
    """A deleted user's console key is revoked (the key row itself stays, unowned)."""
    pre_delete.connect(_revoke_keys_of, sender=get_user_model(), dispatch_uid="console-keys")
