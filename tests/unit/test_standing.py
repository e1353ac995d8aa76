"""Unit tests of how a live read's credentials are judged again (``access.auth.Standing``):
which key changes make it judge again, and a revocation that lands while the request is first
authenticated. The database's part (the notifications the key tables send) is tested through
the real server in ``tests/access/test_live_credentials.py``; here a key's lookup is a
coroutine of the test's own, so that a revocation can land while it is under way."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from access import auth
from access.auth import KeyRecord, Standing, authenticate
from access.grants import Grant, Operation, Principal, stream_resource
from streams.errors import Unauthorized

KEY = "AbCd1234.secretsecretsecretsecretsecretse"
EVERYTHING = (Grant("stream/", frozenset(Operation)),)


@pytest.fixture(autouse=True)
def keys_mode(settings: Any) -> Iterator[None]:
    settings.DS_AUTH_MODE = "keys"
    auth.forget()
    yield
    auth.forget()


def _key_principal(prefix: str) -> Principal:
    return Principal("key", id=prefix, grants=EVERYTHING)


def test_only_a_change_to_its_own_key_makes_a_live_read_judge_again() -> None:
    """Any key's change used to make every live reader judge its credentials again (400
    readers with 400 keys: 391 database transactions at the next append, found by review)."""
    mine, token = _key_principal("AbCd1234"), Principal("jwt", id="user-1", grants=EVERYTHING)
    standing = Standing(mine, None, auth.generation())
    from_token = Standing(token, None, auth.generation())
    auth.forget("key:Other123")
    assert not standing._changed() and not from_token._changed()
    auth.forget("key:AbCd1234")
    assert standing._changed() and not from_token._changed()
    fresh = Standing(mine, None, auth.generation())
    auth.forget("all")  # a TRUNCATE, or a lost LISTEN connection: everything
    assert fresh._changed() and from_token._changed()


def test_a_revocation_during_the_first_authentication_is_not_missed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key is looked up; it is revoked, and the change heard of, while that lookup is
    under way; the lookup answers with the row as it was. The request is served (its
    principal came first), but its live read must judge again at its next event: the
    generation it was judged at is read before it was authenticated (found by review: read
    after, it never judged again)."""
    hashed = auth._hasher.hash(KEY)
    revoked = {"now": False}

    async def lookup(prefix: str) -> KeyRecord:
        as_read = revoked["now"]
        await asyncio.sleep(0.05)
        return KeyRecord(prefix, "n", hashed, as_read, None, None, EVERYTHING)

    monkeypatch.setattr(auth, "_fetch", lookup)
    monkeypatch.setattr(auth, "_may_look_up", lambda: True)

    async def scenario() -> None:
        async def revoke() -> None:
            await asyncio.sleep(0.01)
            revoked["now"] = True
            auth.forget("key:AbCd1234")

        revoking = asyncio.create_task(revoke())
        judged_at = auth.generation()
        principal = await authenticate(f"Bearer {KEY}", {})
        await revoking
        again = Standing(principal, lambda: authenticate(f"Bearer {KEY}", {}), judged_at)
        with pytest.raises(Unauthorized, match="revoked"):
            await again.require(stream_resource("a/b"), Operation.READ)

    asyncio.run(scenario())
