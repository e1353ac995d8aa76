"""Authentication: who sends a request, decided cheaply on the hot path.

Credentials, in order: ``Authorization: Bearer <key>`` (an API key, ``<prefix>.<secret>``),
``Authorization: Bearer <JWT>`` (``access.tokens``), or a signed read URL's query parameters
(``access.signing``). In ``keys`` mode a request without credentials is anonymous (401 for
anything it asks) and bad credentials are a 401 at once; in ``open`` mode everyone may do
everything, and valid credentials only name who did it.

Keys are looked up once per process and kept: a request with a known key costs dictionary
lookups, no hashing and no database. Every change to keys or grants (the admin, commands,
SQL) fires a trigger whose NOTIFY reaches every server process on the live-delivery channel;
it drops the cache, so a revoked key stops working everywhere within the notification's
latency. A lost LISTEN connection drops it too, and entries are reloaded after
``CACHE_SECONDS`` whatever happens.

Keys not cached are looked up one by one, up to ``DS_AUTH__KEY_LOOKUPS_PER_SEC`` a second
per process. Past that (a client making up keys, each with a new id, had the database queried
once per request: docs/reliability.md), an id is first judged by the roster, the list of every
key id (one statement, dropped and expired like the cache): an id not on it is refused
without a lookup. An id not on the roster has it read again at most every
``DS_AUTH__UNKNOWN_KEY_SECS``. So a key made an instant ago is found at once while lookups are
within their rate, and at worst within that long (or when its NOTIFY arrives) beyond it. With
more than ``ROSTER_MAX`` keys there is no roster, and each id is looked up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.conf import settings
from rest_framework_api_key.crypto import KeyGenerator

from access import ratelimit, signing, tokens
from access.grants import ANONYMOUS, OPEN, Grant, Operation, Principal
from streams.errors import Unauthorized

CACHE_SECONDS = 60.0
MAX_CACHED = 10_000
ROSTER_MAX = 100_000
ROSTER_SQL = "SELECT k.prefix FROM ds_api_key AS k LIMIT %s"
# The rate limits' bucket of this process's key lookups (no key id has a space in it).
LOOKUP_BUDGET = "key lookups"
KEY_SQL = (
    "SELECT k.name, k.hashed_key, k.revoked, k.expiry_date, k.rate_limit,"
    " coalesce(json_agg(json_build_array(g.prefix, g.read, g.append, g.manage))"
    "          FILTER (WHERE g.id IS NOT NULL), '[]')"
    " FROM ds_api_key AS k LEFT JOIN ds_api_grant AS g ON g.key_id = k.id"
    " WHERE k.prefix = %s GROUP BY k.id"
)

_hasher = KeyGenerator()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    prefix: str
    name: str
    hashed_key: str
    revoked: bool
    expires_at: datetime | None
    rate_limit: int | None
    grants: tuple[Grant, ...]


@dataclass(frozen=True, slots=True)
class Credential:
    key: str | None = None  # an API key, "<prefix>.<secret>"
    token: str | None = None  # a JWT
    # A signed URL: the key id, its read grant and its expiry (Unix seconds).
    signed: tuple[str, Grant, int] | None = None

    @property
    def key_id(self) -> str | None:
        if self.key is not None:
            return key_id_of(self.key)
        return self.signed[0] if self.signed is not None else None


# prefix -> (record, or None for no such key; when it was loaded)
_records: dict[str, tuple[KeyRecord | None, float]] = {}
# Keys whose hash matched their record, by key id: checked once per process (a change to a key
# drops its own, without a walk through the others).
_matched: dict[str, set[str]] = {}
_lock = threading.Lock()
# key id -> its lookup in progress, shared by the requests that miss the cache meanwhile
_lookups: dict[str, asyncio.Future[KeyRecord | None]] = {}


@dataclass(frozen=True, slots=True)
class Roster:
    """Every key id, as one statement read them when the cache was at ``generation``
    (``ids`` None: more than ROSTER_MAX keys)."""

    ids: frozenset[str] | None
    loaded: float
    generation: int


_roster: Roster | None = None
# The roster's reading in progress, shared by the requests that need it meanwhile.
_roster_read: asyncio.Future[Roster] | None = None
# Counts forget()s: a lookup that began before one may have read what changed since, so its
# result is used once but not kept.
_generation = 0
# The generation at which each key last changed (prefix -> generation; at most MAX_CACHED),
# and at which every key's cache was last dropped: what a live read's credentials are judged
# again by (Standing).
_key_changed: dict[str, int] = {}
_all_changed = 0


def open_mode() -> bool:
    return settings.DS_AUTH_MODE == "open"


def credential_of(authorization: str | None, query: dict[str, list[str]]) -> Credential | None:
    """The credentials a request carries; None without any."""
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        value = value.strip()
        if scheme.lower() != "bearer" or not value:
            raise Unauthorized(
                "send credentials as Authorization: Bearer <key or token>",
                headers={"WWW-Authenticate": 'Bearer realm="durable-streams"'},
            )
        if value.count(".") == 2:
            return Credential(token=value)
        return Credential(key=value)
    signed = signing.verify(query)
    return Credential(signed=signed) if signed is not None else None


async def authenticate(
    authorization: str | None, query: dict[str, list[str]], *, rate_limited: bool = True
) -> Principal:
    """The principal of a request of the lean endpoints (async: the event loop). Not
    ``rate_limited``: a request judged again (``Standing``) is not counted again."""
    try:
        credential = credential_of(authorization, query)
        if credential is None:
            return OPEN if open_mode() else ANONYMOUS
        record = None
        key_id = credential.key_id
        if key_id is not None:
            record = _cached(key_id)
            if record is _MISSING:
                record = await _record_of(key_id)
        principal = None
        if credential.token is not None:
            principal = tokens.cached(credential.token)
            if principal is None:
                principal = await asyncio.to_thread(tokens.verify, credential.token)
        return _conclude(credential, record, principal, rate_limited=rate_limited)
    except Unauthorized:
        if open_mode():
            return OPEN
        raise


def authenticate_sync(authorization: str | None, query: dict[str, list[str]]) -> Principal:
    """The same for Django-served URLs (their views run in threads)."""
    try:
        credential = credential_of(authorization, query)
        if credential is None:
            return OPEN if open_mode() else ANONYMOUS
        record = None
        key_id = credential.key_id
        if key_id is not None:
            record = _cached(key_id)
            if record is _MISSING:
                record = _record_of_sync(key_id)
        principal = tokens.verify(credential.token) if credential.token is not None else None
        return _conclude(credential, record, principal)
    except Unauthorized:
        if open_mode():
            return OPEN
        raise


def _conclude(
    credential: Credential,
    record: KeyRecord | Any | None,
    principal: Principal | None,
    *,
    rate_limited: bool = True,
) -> Principal:
    if credential.token is not None:
        assert principal is not None
    else:
        principal = _key_principal(credential, record)
    if principal.rate_limit is not None and rate_limited:
        # Per key: its signed URLs count against the key's own limit (only keys have one).
        ratelimit.take(f"key:{principal.id}", principal.rate_limit)
    # In open mode everyone may do everything: credentials that expire meanwhile change nothing.
    return replace(principal, unrestricted=True, expires_at=None) if open_mode() else principal


def _key_principal(credential: Credential, record: KeyRecord | None) -> Principal:
    if record is None:
        raise _refused("unknown API key")
    if credential.key is not None and credential.key not in _matched.get(record.prefix, ()):
        if not _hasher.verify(credential.key, record.hashed_key):
            raise _refused("unknown API key")
        with _lock:
            if len(_matched) >= MAX_CACHED:
                _matched.clear()
            _matched.setdefault(record.prefix, set()).add(credential.key)
    if record.revoked:
        raise _refused("this API key was revoked")
    if record.expires_at is not None and record.expires_at.timestamp() <= time.time():
        raise _refused("this API key has expired")
    expires_at = record.expires_at.timestamp() if record.expires_at is not None else None
    principal = Principal(
        "key", id=record.prefix, name=record.name, grants=record.grants,
        rate_limit=float(record.rate_limit) if record.rate_limit else None,
        expires_at=expires_at,
    )  # fmt: skip
    if credential.signed is None:
        return principal
    # A signed URL reads only what it names, and only while its key may read that.
    _, grant, signed_until = credential.signed
    if not principal.allows(grant.prefix, Operation.READ):
        raise _refused("the key that signed this URL may no longer read what it covers")
    until = float(signed_until) if expires_at is None else min(expires_at, signed_until)
    return replace(principal, kind="signed-url", grants=(grant,), expires_at=until)


def _refused(message: str) -> Unauthorized:
    return Unauthorized(message, headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})


_MISSING: Any = object()


def _cached(prefix: str) -> KeyRecord | Any | None:
    entry = _records.get(prefix)
    if entry is None:
        return _MISSING
    record, loaded = entry
    age = time.monotonic() - loaded
    if age > (CACHE_SECONDS if record is not None else settings.DS_AUTH_UNKNOWN_KEY_SECS):
        return _MISSING
    return record


async def _record_of(prefix: str) -> KeyRecord | None:
    """The record of a key not cached: looked up, unless lookups are past their rate and the
    roster has no such key."""
    if prefix in _lookups:  # joined: the lookup under way costs the budget nothing more
        return await _lookup(prefix)
    if not _may_look_up():
        roster = _roster_for(prefix) or await _read_roster()
        if _unknown(prefix, roster):
            return None
        record = _cached(prefix)  # found while the roster was read
        if record is not _MISSING:
            return record
    return await _lookup(prefix)


def _record_of_sync(prefix: str) -> KeyRecord | None:
    if not _may_look_up():
        roster = _roster_for(prefix) or _keep_roster(*_fetch_roster_sync())
        if _unknown(prefix, roster):
            return None
    generation = _generation
    return _remember(prefix, _fetch_sync(prefix), generation)


def _may_look_up() -> bool:
    """Take one lookup from this process's budget (DS_AUTH__KEY_LOOKUPS_PER_SEC)."""
    return ratelimit.spend(LOOKUP_BUDGET, settings.DS_AUTH_KEY_LOOKUPS_PER_SEC) is None


def _roster_for(prefix: str) -> Roster | None:
    """The roster to judge ``prefix`` by; None when it must be read (again)."""
    roster = _roster
    if roster is None or roster.generation != _generation:
        return None
    age = time.monotonic() - roster.loaded
    listed = roster.ids is None or prefix in roster.ids
    if age > CACHE_SECONDS or (not listed and age > settings.DS_AUTH_UNKNOWN_KEY_SECS):
        return None
    return roster


def _unknown(prefix: str, roster: Roster) -> bool:
    """Is there no key ``prefix`` by ``roster``? Not said of a roster read before keys last
    changed (one may have been made meanwhile), nor without a list of ids."""
    return roster.generation == _generation and roster.ids is not None and prefix not in roster.ids


async def _read_roster() -> Roster:
    """The roster from the database, one reading at a time (as _lookup)."""
    global _roster_read
    reading = _roster_read
    if reading is None or reading.done():
        reading = asyncio.ensure_future(_fetch_roster())
        _roster_read = reading
        reading.add_done_callback(lambda done: done.cancelled() or done.exception())
    return await asyncio.shield(reading)


async def _fetch_roster() -> Roster:
    from streams.store.pool import connection

    generation = _generation
    async with connection() as conn:
        cur = await conn.execute(ROSTER_SQL, (ROSTER_MAX + 1,))
        ids = [row[0] for row in await cur.fetchall()]
    return _keep_roster(ids, generation)


def _fetch_roster_sync() -> tuple[list[str], int]:
    from django.db import connection

    generation = _generation
    with connection.cursor() as cursor:
        cursor.execute(ROSTER_SQL, [ROSTER_MAX + 1])
        return [row[0] for row in cursor.fetchall()], generation


def _keep_roster(ids: list[str], generation: int) -> Roster:
    """The roster of ``ids``, read at ``generation``; kept unless keys changed since."""
    global _roster
    roster = Roster(
        frozenset(ids) if len(ids) <= ROSTER_MAX else None, time.monotonic(), generation
    )
    with _lock:
        if generation == _generation:
            _roster = roster
    return roster


async def _lookup(prefix: str) -> KeyRecord | None:
    """The key's record from the database, through one lookup per key at a time: requests
    that arrive together with a key not loaded (a new one, or any after the cache's expiry or
    a change to keys) would otherwise take a connection each, and go on in the order their
    lookups came back rather than the order they came in."""
    lookup = _lookups.get(prefix)
    if lookup is None:
        lookup = asyncio.ensure_future(_fetch_and_remember(prefix))
        _lookups[prefix] = lookup

        def done(_: object, lookup: asyncio.Future[KeyRecord | None] = lookup) -> None:
            if _lookups.get(prefix) is lookup:
                del _lookups[prefix]
            if not lookup.cancelled():
                lookup.exception()  # retrieved, even when every requester has gone

        lookup.add_done_callback(done)
    # Shielded: a requester that leaves does not cancel the others' lookup.
    return await asyncio.shield(lookup)


async def _fetch_and_remember(prefix: str) -> KeyRecord | None:
    generation = _generation
    return _remember(prefix, await _fetch(prefix), generation)


def _remember(prefix: str, record: KeyRecord | None, generation: int) -> KeyRecord | None:
    """Keep ``record``, read when the cache was at ``generation``, unless keys changed
    since (forget): then it is used once but not kept."""
    with _lock:
        if generation != _generation:
            return record
        if len(_records) >= MAX_CACHED:
            _records.clear()
        _records[prefix] = (record, time.monotonic())
    return record


def _record(prefix: str, row: tuple[Any, ...] | None) -> KeyRecord | None:
    if row is None:
        return None
    name, hashed_key, revoked, expires_at, rate_limit, grants = row
    rules = []
    for grant_prefix, read, append, manage in grants:
        operations = {
            op for op, on in ((Operation.READ, read), (Operation.APPEND, append),
                              (Operation.MANAGE, manage)) if on
        }  # fmt: skip
        rules.append(Grant(grant_prefix, frozenset(operations)))
    return KeyRecord(prefix, name, hashed_key, revoked, expires_at, rate_limit, tuple(rules))


async def _fetch(prefix: str) -> KeyRecord | None:
    from streams.store.pool import connection

    if len(prefix) > 8:
        return None
    async with connection() as conn:
        cur = await conn.execute(KEY_SQL, (prefix,))
        return _record(prefix, await cur.fetchone())


def _fetch_sync(prefix: str) -> KeyRecord | None:
    from django.db import connection

    if len(prefix) > 8:
        return None
    with connection.cursor() as cursor:
        cursor.execute(KEY_SQL, [prefix])
        row = cursor.fetchone()
    if row is not None and isinstance(row[5], str):  # json_agg through Django: text
        import json

        row = (*row[:5], json.loads(row[5]))
    return _record(prefix, row)


def generation() -> int:
    """Where the cache of keys stands: read before a request is authenticated, it tells
    whether its key changed since (``Standing``)."""
    return _generation


def forget(payload: str = "") -> None:
    """Drop what is cached of the key a change names (``key:<prefix>``: it, its grants or its
    revocation changed), or of every key and token (``all``: a TRUNCATE; or anything else:
    notifications may have been missed)."""
    global _generation, _roster, _roster_read, _all_changed
    kind, _, prefix = payload.partition(":")
    with _lock:
        _generation += 1
        _roster = _roster_read = None  # a key made or removed changes it
        if kind == "key" and prefix:
            _records.pop(prefix, None)
            _lookups.pop(prefix, None)
            _matched.pop(prefix, None)
            if len(_key_changed) >= MAX_CACHED:
                _key_changed.clear()
                _all_changed = _generation
            else:
                _key_changed[prefix] = _generation
            return
        _all_changed = _generation
        _key_changed.clear()
        _records.clear()
        _matched.clear()
        _lookups.clear()
    tokens.forget()


def key_id_of(key: str) -> str:
    return key.partition(".")[0]


def listen_for_changes() -> None:
    """Hear of key changes from every process (``access/sql``'s triggers)."""
    from streams.live import hub

    hub.add_handler("auth", forget)
    hub.add_reconnect_hook(forget)


class Standing:
    """The credential of a request that goes on answering long after it was authenticated (a
    live read), judged again where the request is about to hand out more: a key revoked, or
    its grants changed, since the request began stops it within the change's notification
    (``forget``), and an expired key, signed URL or token stops it once its time has passed.

    ``judge`` authenticates the request's credentials again, as its endpoint did at first;
    without it, only the expiry is checked. ``judged_at`` is ``generation()`` as it was
    before the request was first authenticated (a change while that was in flight counts).
    Judging again costs nothing until the request's own key changes, or every key's cache is
    dropped (then one lookup per key, shared by its requests: ``_lookup``)."""

    __slots__ = ("_generation", "_judge", "principal")

    def __init__(
        self,
        principal: Principal,
        judge: Callable[[], Awaitable[Principal]] | None,
        judged_at: int,
    ) -> None:
        self.principal = principal
        self._judge = judge
        self._generation = judged_at

    def _changed(self) -> bool:
        """Whether what the principal was judged by may have changed since."""
        if _all_changed > self._generation:
            return True
        if self.principal.kind in ("key", "signed-url"):
            return _key_changed.get(self.principal.id, -1) > self._generation
        return False  # tokens and service secrets do not change with the keys

    async def require(self, resource: str, operation: Operation) -> None:
        """As ``Principal.require``, for the credential as it stands now: 401 when it was
        revoked or has expired, 403 when its grants no longer cover ``resource``."""
        if self._judge is not None and self._changed():
            self._generation = _generation
            self.principal = await self._judge()
        expires_at = self.principal.expires_at
        if expires_at is not None and expires_at <= time.time():
            raise _refused("the credentials of this request have expired")
        self.principal.require(resource, operation)
