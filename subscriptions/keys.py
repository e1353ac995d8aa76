"""The webhook signing key of this process and the JWK Set (PROTOCOL.md 6.5).

The key to sign with is read from the database and kept ``KEY_CACHE_SECONDS`` (a rotation
takes effect within that); a server with no key (or none it can decrypt: the secret key
changed) makes one, once across processes. The JWKS lists every published key.
"""

from __future__ import annotations

import asyncio
import logging
import time

from subscriptions import signing, store

logger = logging.getLogger(__name__)

_key: tuple[signing.SigningKey, float] | None = None
_lock: asyncio.Lock | None = None


async def signing_key() -> signing.SigningKey:
    global _key, _lock
    if _key is not None and time.monotonic() - _key[1] < signing.KEY_CACHE_SECONDS:
        return _key[0]
    if _lock is None:
        _lock = asyncio.Lock()
    async with _lock:
        if _key is not None and time.monotonic() - _key[1] < signing.KEY_CACHE_SECONDS:
            return _key[0]
        key = await _load()
        if key is None:
            logger.warning("no usable webhook signing key: generating one")
            await store.add_key(signing.generate_key(), only_if_none_usable=True)
            key = await _load()
        if key is None:  # pragma: no cover - the key just stored is readable
            raise RuntimeError("could not load the webhook signing key just stored")
        _key = (key, time.monotonic())
        return key


async def _load() -> signing.SigningKey | None:
    for kid, encrypted in await store.signing_keys():
        key = signing.load_key(kid, encrypted)
        if key is not None:
            return key
        logger.warning("webhook signing key %s was encrypted under another secret key", kid)
    return None


async def jwks() -> dict[str, list[dict[str, str]]]:
    await signing_key()  # a server that never signed yet publishes the key it will use
    return {"keys": [signing.jwk(kid, x) for kid, x in await store.published_keys()]}
