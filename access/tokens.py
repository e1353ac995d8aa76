"""Tokens from an identity provider: ``Authorization: Bearer <JWT>`` (PyJWT).

Accepted when signed by a key of the configured JWKS (a URL, fetched and cached by PyJWT's
``PyJWKClient``, or a file), with the configured issuer and audience, not expired. The grants
claim (``DS_AUTH__JWT_GRANTS_CLAIM``, default ``ds_grants``) carries grants in the form API
keys use: a list of ``"PREFIX:op,op"`` strings or ``{"prefix": ..., "operations": [...]}``
objects. The principal is ``jwt:<sub>``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import jwt
from django.conf import settings

from access.grants import Grant, Operation, Principal, normalize_prefix
from streams.errors import Unauthorized

logger = logging.getLogger(__name__)

# Verified tokens, until they expire (bounded: cleared when full).
_verified: dict[str, tuple[Principal, float]] = {}
MAX_CACHED = 10_000
_lock = threading.Lock()
_jwks_client: jwt.PyJWKClient | None = None
_jwks_file: tuple[float, jwt.PyJWKSet] | None = None


def enabled() -> bool:
    return bool(settings.DS_AUTH_JWT_JWKS_URL or settings.DS_AUTH_JWT_JWKS_FILE)


def cached(token: str) -> Principal | None:
    entry = _verified.get(token)
    if entry is None or entry[1] <= time.time():
        return None
    return entry[0]


def verify(token: str) -> Principal:
    """The principal of a JWT; 401 when it is not acceptable. May fetch the JWKS (blocking):
    the hot path calls it in a worker thread, and only for tokens not verified before."""
    principal = cached(token)
    if principal is not None:
        return principal
    if not enabled():
        raise _refused("this server accepts no identity-provider tokens")
    try:
        key = _signing_key(token)
        claims = jwt.decode(
            token,
            key=key.key,
            algorithms=settings.DS_AUTH_JWT_ALGORITHMS,
            audience=settings.DS_AUTH_JWT_AUDIENCE or None,
            issuer=settings.DS_AUTH_JWT_ISSUER or None,
            options={"require": ["exp", "sub"]},
        )
    except (jwt.PyJWTError, ValueError) as exc:
        raise _refused(f"the token was refused: {exc}") from None
    # PyJWT takes an empty subject (every such token one principal, ``jwt:``) and an expiry
    # as text (RFC 7519: a NumericDate is a JSON number).
    if not claims["sub"] or isinstance(claims["exp"], bool | str):
        raise _refused("the token was refused: an empty subject, or an expiry that is text")
    principal = Principal(
        "jwt",
        id=str(claims["sub"]),
        name=str(claims.get("name") or claims["sub"]),
        grants=_grants(claims.get(settings.DS_AUTH_JWT_GRANTS_CLAIM)),
        expires_at=float(claims["exp"]),
    )
    with _lock:
        if len(_verified) >= MAX_CACHED:
            _verified.clear()
        _verified[token] = (principal, float(claims["exp"]))
    return principal


def _signing_key(token: str) -> jwt.PyJWK:
    """The key of the identity provider's that verifies ``token``: the one its ``kid`` names
    (without one, the first), of a type its algorithm can verify with. PyJWT handed an ES256
    token an RSA key and raised TypeError, a 500 for anyone who sent one (probe 10h); of keys
    without a kid only the first was tried (review)."""
    global _jwks_client, _jwks_file
    header = jwt.get_unverified_header(token)
    kid, alg = header.get("kid"), header.get("alg")
    if settings.DS_AUTH_JWT_JWKS_URL:
        with _lock:
            if _jwks_client is None:
                _jwks_client = jwt.PyJWKClient(
                    settings.DS_AUTH_JWT_JWKS_URL, cache_keys=True, lifespan=300, timeout=5
                )
        named = [_jwks_client.get_signing_key_from_jwt(token)]
    else:
        path = Path(settings.DS_AUTH_JWT_JWKS_FILE)
        try:
            mtime = path.stat().st_mtime
            with _lock:
                if _jwks_file is None or _jwks_file[0] != mtime:
                    _jwks_file = (mtime, jwt.PyJWKSet.from_dict(json.loads(path.read_text())))
                keys = _jwks_file[1]
        except (OSError, json.JSONDecodeError) as exc:
            # Replaced, or removed, meanwhile: no token can be verified now (it was a 500 for
            # anyone: review).
            logger.warning("the JWKS file %s cannot be read: %s", path, exc)
            raise ValueError("the identity provider's keys cannot be read") from None
        named = [key for key in keys.keys if kid is None or key.key_id == kid]
        if not named:
            raise ValueError(f"no key {kid!r} in the JWKS")
    for key in named:
        if isinstance(alg, str) and _KEY_TYPES.get(alg[:2]) == key.key_type:
            return key
    raise ValueError(f"the token's algorithm {alg!r} does not fit its key")


# The type of key (the JWK's kty) each family of algorithms verifies with.
_KEY_TYPES = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP", "HS": "oct"}


def _grants(claim: Any) -> tuple[Grant, ...]:
    if claim is None:
        return ()
    if not isinstance(claim, list):
        raise _refused("the token's grants claim must be a list")
    grants = []
    for item in claim:
        try:
            if isinstance(item, str):
                grants.append(Grant.parse(item))
            elif isinstance(item, dict):
                operations = frozenset(Operation(op) for op in item.get("operations", ()))
                grants.append(Grant(normalize_prefix(str(item.get("prefix", ""))), operations))
            else:
                raise ValueError(f"not a grant: {item!r}")
        except (ValueError, TypeError) as exc:
            raise _refused(f"the token's grants claim is malformed: {exc}") from None
    return tuple(grants)


def _refused(message: str) -> Unauthorized:
    return Unauthorized(message, headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})


def forget() -> None:
    with _lock:
        _verified.clear()
