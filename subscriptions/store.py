"""All SQL of subscriptions: one call of a function of ``sql/subscriptions.sql`` per operation,
in one round trip, on the server's async pool (``streams.store.pool``).

Invariants (PROTOCOL.md 6, 7), kept by the SQL under the subscription's row lock: at most one
wake in flight per subscription, across every process; a generation only grows; a cursor never
moves back and only to positions its stream minted; a token's wake and generation must be the
current ones. Operations return ``SubOutcome`` values, mapped to answers by the service layer
(``subscriptions.outcomes``). A deadlock (possible with concurrent stream deletes) is retried.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from psycopg import errors

from streams.store.pool import connection
from subscriptions.outcomes import SubOutcome
from subscriptions.protocol import Ack, SubscriptionConfig, glob_prefix, glob_regex
from subscriptions.signing import NewKey, load_key

logger = logging.getLogger(__name__)

RETRIES = 5
# How many subscriptions one sweep statement handles.
SWEEP_LIMIT = 500


@dataclass(frozen=True, slots=True)
class Delivery:
    """A webhook wake this process issued and must send (PROTOCOL.md 7.1)."""

    sid: int
    subscription_id: str
    generation: int
    wake_id: str
    url: str
    base_url: str
    streams: list[dict[str, Any]]

    @classmethod
    def of(cls, value: Any) -> Delivery | None:
        if value is None:
            return None
        data = value if isinstance(value, dict) else json.loads(value)
        return cls(
            sid=data["sid"],
            subscription_id=data["subscription_id"],
            generation=data["generation"],
            wake_id=data["wake_id"],
            url=data["url"],
            base_url=data["base_url"],
            streams=data["streams"] or [],
        )


@dataclass(frozen=True, slots=True)
class SubscriptionView:
    """A subscription as GET shows it (PROTOCOL.md 6.3)."""

    subscription_id: str
    type: str
    pattern: str | None
    streams: list[dict[str, Any]]
    webhook_url: str | None
    wake_stream: str | None
    lease_ttl_ms: int
    description: str | None
    created_at: datetime
    failed: bool
    base_url: str


@dataclass(frozen=True, slots=True)
class Report:
    outcome: SubOutcome
    next_wake: bool
    detail: str | None
    delivery: Delivery | None


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: SubOutcome
    sid: int | None
    generation: int | None
    wake_id: str | None
    holder: str | None
    lease_ttl_ms: int | None
    streams: list[dict[str, Any]]


async def _call(sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    for attempt in range(RETRIES):
        try:
            async with connection() as conn:
                cur = await conn.execute(sql, params)
                return await cur.fetchall() if cur.description is not None else []
        except (errors.DeadlockDetected, errors.SerializationFailure):
            if attempt == RETRIES - 1:
                raise
            logger.warning("retrying a subscription change after a lock conflict")
            await asyncio.sleep(0.005 * (attempt + 1) * (1 + random.random()))
    raise AssertionError("unreachable")


def _send_secs() -> float:
    """After this long the process sending a webhook is presumed dead (the request itself
    times out first)."""
    return float(settings.DS_SUBSCRIPTIONS_WEBHOOK_TIMEOUT_SECS) + 5.0


def _wake_params(sender: str) -> tuple[Any, ...]:
    return (sender, _send_secs(), settings.DS_MAX_STREAM_BYTES)


# -- management (PROTOCOL.md 6) ------------------------------------------------------------------


async def create(
    *, subscription_id: str, config: SubscriptionConfig, base_url: str, created_by: str | None
) -> SubOutcome:
    pattern = config.pattern
    rows = await _call(
        "SELECT ds_sub_create(%s, %s, %s, %s, %s, %s::text[], %s, %s, %s, %s, %s, %s, %s)",
        (
            subscription_id,
            config.type,
            pattern,
            glob_regex(pattern) if pattern is not None else None,
            glob_prefix(pattern) if pattern is not None else None,
            list(config.streams),
            config.webhook_url,
            config.wake_stream,
            config.lease_ttl_ms,
            config.description,
            config.config_hash(),
            base_url,
            created_by,
        ),
    )
    return SubOutcome(rows[0][0])


_GET_SQL = (
    "SELECT subscription_id, type, pattern, ds_sub_streams(id, false), webhook_url,"
    " wake_stream, lease_ttl_ms, description, created_at, next_attempt_at IS NOT NULL, base_url"
    " FROM ds_subscription WHERE subscription_id = %s"
)


async def get(subscription_id: str) -> SubscriptionView | None:
    rows = await _call(_GET_SQL, (subscription_id,))
    if not rows:
        return None
    return SubscriptionView(*rows[0])


async def delete(subscription_id: str) -> SubOutcome:
    rows = await _call("SELECT ds_sub_delete(%s)", (subscription_id,))
    return SubOutcome(rows[0][0])


async def add_streams(subscription_id: str, streams: list[str]) -> SubOutcome:
    rows = await _call("SELECT ds_sub_add_streams(%s, %s::text[])", (subscription_id, streams))
    return SubOutcome(rows[0][0])


async def remove_stream(subscription_id: str, path: str) -> SubOutcome:
    rows = await _call("SELECT ds_sub_remove_stream(%s, %s)", (subscription_id, path))
    return SubOutcome(rows[0][0])


async def wake_stream_of(subscription_id: str) -> str | None:
    rows = await _call(
        "SELECT wake_stream FROM ds_subscription WHERE subscription_id = %s", (subscription_id,)
    )
    return rows[0][0] if rows else None


# -- wakes (PROTOCOL.md 7) -----------------------------------------------------------------------


async def wake(sids: list[int], sender: str) -> list[Delivery]:
    """Issue wakes for these subscriptions if idle with pending work; the webhook wakes this
    process must now send."""
    rows = await _call(
        "SELECT ds_sub_wake(%s::bigint[], %s, %s, %s)", (sids, *_wake_params(sender))
    )
    return [d for (value,) in rows if (d := Delivery.of(value)) is not None]


async def candidates() -> list[int]:
    rows = await _call("SELECT ds_sub_candidates(%s)", (SWEEP_LIMIT,))
    return [sid for (sid,) in rows]


async def due() -> list[int]:
    """Idle subscriptions whose retry fell due, with pending work."""
    rows = await _call("SELECT ds_sub_due(%s)", (SWEEP_LIMIT,))
    return [sid for (sid,) in rows]


async def sweep_step(after: tuple[int, str], links: int) -> tuple[list[int], tuple[int, str]]:
    """Idle subscriptions with pending work, looking at ``links`` links at most from the
    cursor ``after`` on; and the cursor of the next step ((0, "") once all were looked at)."""
    rows = await _call(
        "SELECT sids, next_sid, next_path FROM ds_sub_sweep_step(%s, %s, %s)", (*after, links)
    )
    sids, next_sid, next_path = rows[0]
    return list(sids), (next_sid, next_path)


async def following(stream_ids: list[int]) -> list[int]:
    """The subscriptions linked to these streams."""
    rows = await _call(
        "SELECT DISTINCT l.sid FROM ds_stream AS t"
        " JOIN ds_subscription_link AS l ON l.path = t.path WHERE t.id = ANY(%s::bigint[])",
        (stream_ids,),
    )
    return [sid for (sid,) in rows]


async def expire() -> list[int]:
    rows = await _call("SELECT ds_sub_expire(%s)", (SWEEP_LIMIT,))
    return [sid for (sid,) in rows]


async def release_sending(sender: str) -> None:
    """End, at the next sweep, the webhook wakes ``sender`` is sending (it is stopping)."""
    await _call(
        "UPDATE ds_subscription SET send_deadline = now()"
        " WHERE sender = %s AND wake_state = 'sending'",
        (sender,),
    )


async def delivered(
    delivery: Delivery, *, done: bool, error: str | None, sender: str
) -> Delivery | None:
    """Record a webhook request's outcome; the next delivery when ``done`` left work pending."""
    jitter = random.uniform(-0.2, 0.2)
    rows = await _call(
        "SELECT ds_sub_delivered(%s, %s, %s, %s, %s, %s, %s, %s)",
        (delivery.sid, delivery.wake_id, done, error, jitter, *_wake_params(sender)),
    )
    return Delivery.of(rows[0][0])


async def report(
    *,
    subscription_id: str,
    type: str,
    token_sid: int,
    token_generation: int,
    token_wake_id: str,
    generation: int,
    wake_id: str,
    acks: tuple[Ack, ...],
    done: bool,
    release: bool,
    sender: str,
) -> Report:
    rows = await _call(
        "SELECT outcome, next_wake, detail, delivery"
        " FROM ds_sub_report(%s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s)",
        (
            subscription_id,
            type,
            token_sid,
            token_generation,
            token_wake_id,
            generation,
            wake_id,
            json.dumps([[a.stream, a.offset.seq, a.offset.pos] for a in acks]),
            done,
            release,
            *_wake_params(sender),
        ),
    )
    outcome, next_wake, detail, delivery = rows[0]
    return Report(SubOutcome(outcome), bool(next_wake), detail, Delivery.of(delivery))


async def claim(subscription_id: str, worker: str) -> Claim:
    rows = await _call(
        "SELECT outcome, sid, generation, wake_id, holder, lease_ttl_ms, streams"
        " FROM ds_sub_claim(%s, %s, %s)",
        (subscription_id, worker, settings.DS_MAX_STREAM_BYTES),
    )
    outcome, sid, generation, wake_id, holder, lease_ttl_ms, streams = rows[0]
    return Claim(SubOutcome(outcome), sid, generation, wake_id, holder, lease_ttl_ms, streams or [])


# -- webhook signing keys (subscriptions.signing) ------------------------------------------------

# Keys published in the JWKS: all but those a newer key replaced more than an hour ago.
_PUBLISHED = (
    "SELECT kid, public_x FROM ds_webhook_key AS k WHERE NOT EXISTS ("
    " SELECT 1 FROM ds_webhook_key AS n WHERE n.created_at > k.created_at"
    " AND n.activates_at < now() - interval '1 hour') ORDER BY created_at"
)
_SIGNING = (
    "SELECT kid, private_key FROM ds_webhook_key WHERE activates_at <= now()"
    " ORDER BY activates_at DESC, created_at DESC"
)


async def published_keys() -> list[tuple[str, str]]:
    return [(kid, x) for kid, x in await _call(_PUBLISHED, ())]


async def signing_keys() -> list[tuple[str, bytes]]:
    """Active keys, the one to sign with first."""
    return [(kid, bytes(private)) for kid, private in await _call(_SIGNING, ())]


async def add_key(key: NewKey, *, only_if_none_usable: bool) -> None:
    """Store a new key, active at once. With ``only_if_none_usable`` (the first delivery of a
    server with no key, or none it can decrypt), processes racing to do it add one between
    them (an advisory lock)."""
    async with connection() as conn, conn.transaction():
        if only_if_none_usable:
            await conn.execute("SELECT pg_advisory_xact_lock(6275718392002)")
            cur = await conn.execute(_SIGNING)
            if any(load_key(kid, bytes(p)) for kid, p in await cur.fetchall()):
                return
        await conn.execute(
            "INSERT INTO ds_webhook_key (kid, public_x, private_key, created_at, activates_at)"
            " VALUES (%s, %s, %s, now(), now()) ON CONFLICT (kid) DO NOTHING",
            (key.kid, key.public_x, key.encrypted_private),
        )
