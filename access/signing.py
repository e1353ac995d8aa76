"""Signed read URLs: read access to one stream (or a prefix) until a time, carried in the query
string, for clients that cannot send headers (a browser's ``EventSource``) and for CDNs.

A signed URL names the API key that minted it, and is honoured only while that key is valid
and may still read what the URL covers: revoking the key revokes its URLs. The signature is an
HMAC-SHA256 (Django's ``salted_hmac``) with ``DS_AUTH_SIGNING_KEY`` (the secret key by default)
over the key id, the scope, whether it is exact, and the expiry.
"""

from __future__ import annotations

import time
from urllib.parse import urlencode

from django.conf import settings
from django.utils.crypto import constant_time_compare, salted_hmac

from access.grants import Grant, Operation, normalize_prefix, stream_resource
from streams.errors import BadRequest, Unauthorized
from streams.http.request import check_stream_path

SALT = "durable-streams.signed-read-url"
KEY, SCOPE, EXACT, EXPIRES, SIGNATURE = "ds_key", "ds_scope", "ds_exact", "ds_expires", "ds_sig"
PARAMS = (KEY, SCOPE, EXACT, EXPIRES, SIGNATURE)


def scope_of(stream: str | None, prefix: str | None) -> str:
    """What a signed URL for one ``stream``, or for a ``prefix``, covers; BadRequest unless
    the stream's path is valid or the prefix could begin one (``a/../b`` made a URL into
    another tenant's stream, found by a probe)."""
    if stream is not None:
        return stream_resource(check_stream_path(stream))
    scope = normalize_prefix(prefix or "")
    head, slash, rest = scope.partition("/")
    if head != "stream" or not slash:
        raise BadRequest("a signed URL's prefix begins with stream/")
    if rest:
        check_stream_path(rest.removesuffix("/"))
    return scope


def _signature(key_id: str, scope: str, exact: bool, expires: int) -> str:
    message = f"{key_id}\n{scope}\n{int(exact)}\n{expires}"
    secret = settings.DS_AUTH_SIGNING_KEY or settings.SECRET_KEY
    return salted_hmac(SALT, message, secret=secret, algorithm="sha256").hexdigest()


def sign(key_id: str, scope: str, *, exact: bool, expires: int) -> dict[str, str]:
    """The query parameters of a URL reading ``scope`` (a resource such as
    ``stream/rooms/42``, or a prefix) until ``expires`` (Unix seconds)."""
    scope = normalize_prefix(scope)
    return {
        KEY: key_id,
        SCOPE: scope,
        EXACT: "1" if exact else "0",
        EXPIRES: str(expires),
        SIGNATURE: _signature(key_id, scope, exact, expires),
    }


def query_string(params: dict[str, str]) -> str:
    return urlencode(params)


def verify(query: dict[str, list[str]]) -> tuple[str, Grant, int] | None:
    """The key id, the read grant and the expiry (Unix seconds) a signed URL carries; None
    when the query is not signed. 401 when it is signed wrongly or has expired."""
    if SIGNATURE not in query:
        return None
    values = {}
    for name in PARAMS:
        given = query.get(name)
        if not given or len(given) != 1:
            raise _refused(f"a signed URL needs exactly one {name}")
        values[name] = given[0]
    expires_text = values[EXPIRES]
    if not (expires_text.isascii() and expires_text.isdigit()) or len(expires_text) > 12:
        raise _refused("the signed URL's expiry is malformed")
    expires = int(expires_text)
    exact = values[EXACT] == "1"
    expected = _signature(values[KEY], values[SCOPE], exact, expires)
    if not constant_time_compare(expected, values[SIGNATURE]):
        raise _refused("the signed URL's signature does not match")
    if expires <= time.time():
        raise _refused("the signed URL has expired")
    return values[KEY], Grant(values[SCOPE], frozenset({Operation.READ}), exact=exact), expires


def _refused(message: str) -> Unauthorized:
    return Unauthorized(message, headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
