"""What a subscription request does (PROTOCOL.md 6, 7): authorize, validate, one store call, and
hand any webhook wake it issued to this process's delivery.

Access control (PROTOCOL.md 12.1; ``access.grants``): a subscription is the resource
``stream/__ds/subscriptions/<id>``. Creating, deleting and changing its streams need ``manage``
on it; reading it ``read``; claiming a pull-wake needs ``append`` on it (a claim moves the
subscription along: it takes the lease). A subscription hands the streams it follows to its
worker, so its creator must be allowed to ``read`` them (the pattern's literal beginning,
each explicit stream), and to ``append`` to a pull-wake subscription's wake stream, which the
server writes on its behalf. Callbacks, acks and releases carry the wake's own token instead
of credentials: it is good for that subscription, generation and wake only (12.9).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from access.grants import Operation, Principal, stream_resource
from streams import metrics
from streams.extensions import READ_ONLY_PATHS
from subscriptions import delivery, signing, ssrf, store
from subscriptions.outcomes import SUCCESSES, SubOutcome, refusal
from subscriptions.protocol import (
    PULL_WAKE,
    WEBHOOK,
    SubscriptionError,
    invalid,
    not_found,
    parse_config,
    parse_streams_body,
    parse_wake_report,
    parse_worker,
)

RESOURCE_PREFIX = "stream/__ds/subscriptions/"


def resource(subscription_id: str) -> str:
    return RESOURCE_PREFIX + subscription_id


def _check(outcome: SubOutcome, detail: str | None = None) -> SubOutcome:
    if outcome not in SUCCESSES:
        raise refusal(outcome, detail)
    return outcome


async def put_subscription(
    *, subscription_id: str, principal: Principal, body: dict[str, Any], base_url: str
) -> tuple[bool, store.SubscriptionView]:
    """Create, or re-confirm an identical configuration (PROTOCOL.md 6.2): (created, view)."""
    principal.require(resource(subscription_id), Operation.MANAGE)
    config = parse_config(body)
    for path in config.readable_prefixes():
        principal.require(stream_resource(path), Operation.READ)
    if config.wake_stream is not None:
        if config.wake_stream in READ_ONLY_PATHS:
            raise invalid(f"{config.wake_stream} is written by the server only")
        principal.require(stream_resource(config.wake_stream), Operation.APPEND)
    if config.webhook_url is not None:
        await ssrf.validate(
            config.webhook_url, allow_loopback=settings.DS_SUBSCRIPTIONS_ALLOW_LOOPBACK_WEBHOOKS
        )
    outcome = await store.create(
        subscription_id=subscription_id,
        config=config,
        base_url=base_url,
        created_by=principal.label,
    )
    _check(outcome, "wake_stream cannot also be one of the subscription's streams")
    view = await store.get(subscription_id)
    if view is None:  # deleted between the two statements
        raise not_found()
    return outcome == SubOutcome.CREATED, view


async def get_subscription(*, subscription_id: str, principal: Principal) -> store.SubscriptionView:
    principal.require(resource(subscription_id), Operation.READ)
    view = await store.get(subscription_id)
    if view is None:
        raise not_found()
    return view


async def delete_subscription(*, subscription_id: str, principal: Principal) -> None:
    """Deleting is idempotent (PROTOCOL.md 6.3: 204 whether or not it existed)."""
    principal.require(resource(subscription_id), Operation.MANAGE)
    await store.delete(subscription_id)


async def add_streams(*, subscription_id: str, principal: Principal, body: dict[str, Any]) -> None:
    principal.require(resource(subscription_id), Operation.MANAGE)
    streams = parse_streams_body(body)
    for path in streams:
        principal.require(stream_resource(path), Operation.READ)
    _check(
        await store.add_streams(subscription_id, streams),
        "the wake stream cannot also be one of the subscription's streams",
    )


async def remove_stream(*, subscription_id: str, principal: Principal, path: str) -> None:
    principal.require(resource(subscription_id), Operation.MANAGE)
    _check(await store.remove_stream(subscription_id, path))


async def claim(
    *, subscription_id: str, principal: Principal, body: dict[str, Any]
) -> dict[str, Any]:
    """A pull-wake worker claims the wake (PROTOCOL.md 7.2): the answer with its token."""
    principal.require(resource(subscription_id), Operation.APPEND)
    worker = parse_worker(body)
    claimed = await store.claim(subscription_id, worker)
    metrics.SUB_REQUESTS.labels("claim", claimed.outcome.value).inc()
    if claimed.outcome == SubOutcome.ALREADY_CLAIMED:
        raise SubscriptionError(
            409,
            "ALREADY_CLAIMED",
            "another worker holds the lease",
            fields={"current_holder": claimed.holder, "generation": claimed.generation},
        )
    _check(claimed.outcome, PULL_WAKE)
    assert claimed.sid is not None and claimed.generation is not None and claimed.wake_id
    token = signing.issue_token(
        sid=claimed.sid, generation=claimed.generation, wake_id=claimed.wake_id, use=signing.CLAIM
    )
    return {
        "wake_id": claimed.wake_id,
        "generation": claimed.generation,
        "token": token,
        "streams": claimed.streams,
        "lease_ttl_ms": claimed.lease_ttl_ms,
    }


async def report(
    *, subscription_id: str, kind: str, authorization: str | None, body: dict[str, Any]
) -> store.Report:
    """A webhook callback, or a pull-wake ack or release (PROTOCOL.md 7.1-7.3), authorized by
    the token of the wake it is about."""
    use = signing.CALLBACK if kind == "callback" else signing.CLAIM
    claims = signing.verify_token(signing.bearer_token(authorization), use=use)
    report = parse_wake_report(body, acks_allowed=kind != "release")
    result = await store.report(
        subscription_id=subscription_id,
        type=WEBHOOK if kind == "callback" else PULL_WAKE,
        token_sid=claims.sid,
        token_generation=claims.generation,
        token_wake_id=claims.wake_id,
        generation=report.generation,
        wake_id=report.wake_id,
        acks=report.acks,
        done=report.done,
        release=kind == "release",
        sender=delivery.SENDER,
    )
    metrics.SUB_REQUESTS.labels(kind, result.outcome.value).inc()
    _check(result.outcome, result.detail)
    if result.delivery is not None:
        delivery.send(result.delivery)
    return result
