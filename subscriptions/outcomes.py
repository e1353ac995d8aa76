"""The one vocabulary of subscription outcomes, shared by the SQL functions and Python.

The functions of ``sql/subscriptions.sql`` return these, typed in the database as the ENUM
``ds_sub_outcome`` (migration 0001), whose labels are checked at start-up to be exactly these
(``streams.store.schema.verify_installed``). Each refusal maps to its answer here, in one table
(PROTOCOL.md 6, 7: the codes and statuses the protocol names).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from subscriptions.protocol import SubscriptionError, invalid, not_found


class SubOutcome(StrEnum):
    CREATED = "created"
    EXISTS = "exists"
    CONFLICT = "conflict"
    OK = "ok"
    NOT_FOUND = "not_found"
    WRONG_TYPE = "wrong_type"
    TOKEN_INVALID = "token_invalid"
    FENCED = "fenced"
    ALREADY_CLAIMED = "already_claimed"
    NO_PENDING_WORK = "no_pending_work"
    PAUSED = "paused"
    INVALID_OFFSET = "invalid_offset"
    INVALID_STREAM = "invalid_stream"


SUCCESSES = frozenset({SubOutcome.CREATED, SubOutcome.EXISTS, SubOutcome.OK})

ERRORS: dict[SubOutcome, Callable[[str], SubscriptionError]] = {
    SubOutcome.CONFLICT: lambda detail: SubscriptionError(
        409,
        "SUBSCRIPTION_ALREADY_EXISTS",
        "a subscription with this id exists with a different configuration",
    ),
    SubOutcome.NOT_FOUND: lambda detail: not_found(),
    SubOutcome.WRONG_TYPE: lambda detail: invalid(f"this is not a {detail} subscription"),
    SubOutcome.TOKEN_INVALID: lambda detail: SubscriptionError(
        401,
        "TOKEN_INVALID",
        "the token was issued for another subscription",
        headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
    ),
    SubOutcome.FENCED: lambda detail: SubscriptionError(
        409, "FENCED", "the wake generation is stale"
    ),
    # ALREADY_CLAIMED carries the holder and generation: raised by the service itself.
    SubOutcome.NO_PENDING_WORK: lambda detail: SubscriptionError(
        409, "NO_PENDING_WORK", "the subscription has no pending work"
    ),
    SubOutcome.PAUSED: lambda detail: SubscriptionError(
        409, "SUBSCRIPTION_PAUSED", "the subscription is paused by an operator"
    ),
    SubOutcome.INVALID_OFFSET: lambda detail: SubscriptionError(409, "INVALID_OFFSET", detail),
    SubOutcome.INVALID_STREAM: lambda detail: invalid(detail),
}


def refusal(outcome: SubOutcome, detail: str | None = None) -> SubscriptionError:
    return ERRORS[outcome](detail or "")


def _complete() -> None:
    """Every outcome is a success, has its answer, or is answered by the service itself."""
    missing = set(SubOutcome) - SUCCESSES - set(ERRORS) - {SubOutcome.ALREADY_CLAIMED}
    assert not missing, f"outcomes without an answer: {missing}"


_complete()
