"""Services of access control for management commands and the admin: keys and signed URLs."""

from __future__ import annotations

import time
from datetime import datetime

from django.contrib.auth import get_user_model
from django.db import transaction

from access import signing
from access.grants import Grant as GrantRule
from access.grants import Operation
from access.models import ApiKey, Grant

# What the rate limit's column holds (a PositiveIntegerField).
MAX_RATE_LIMIT = 2**31 - 1


@transaction.atomic
def create_key(
    *,
    name: str,
    grants: list[GrantRule],
    owner: str | None = None,
    expires_at: datetime | None = None,
    rate_limit: int | None = None,
) -> tuple[ApiKey, str]:
    """A new key and its plaintext (shown once: only its hash is stored). ValueError for a
    name, grant or rate the tables cannot hold, or an owner who does not exist."""
    _check_key(name, grants, rate_limit)
    user = get_user_model().objects.filter(username=owner).first() if owner else None
    if owner and user is None:
        raise ValueError(f"there is no user {owner!r}")
    created, plaintext = ApiKey.objects.create_key(
        name=name, owner=user, expiry_date=expires_at, rate_limit=rate_limit
    )
    assert isinstance(created, ApiKey)
    key = created
    for rule in grants:
        Grant.objects.create(
            key=key,
            prefix=rule.prefix,
            read=Operation.READ in rule.operations,
            append=Operation.APPEND in rule.operations,
            manage=Operation.MANAGE in rule.operations,
        )
    return key, plaintext


def _check_key(name: str, grants: list[GrantRule], rate_limit: int | None) -> None:
    longest_name = ApiKey._meta.get_field("name").max_length or 0
    if not name or len(name) > longest_name:
        raise ValueError(f"a key's name is 1 to {longest_name} characters")
    longest_prefix = Grant._meta.get_field("prefix").max_length or 0
    for rule in grants:
        if len(rule.prefix) > longest_prefix:
            raise ValueError(f"a grant's prefix is at most {longest_prefix} characters")
    if rate_limit is not None and not 0 <= rate_limit <= MAX_RATE_LIMIT:
        raise ValueError(f"a rate limit is 0 to {MAX_RATE_LIMIT} requests per second")


def revoke_key(prefix: str) -> ApiKey:
    key = ApiKey.objects.get(prefix=prefix)
    if not key.revoked:
        key.revoked = True
        key.save(update_fields=["revoked"])
    return key


def signed_query(*, key_id: str, scope: str, exact: bool, expires_in: int) -> str:
    """The query string of a signed read URL; the key must exist and may read ``scope``."""
    key = ApiKey.objects.prefetch_related("grants").get(prefix=key_id)
    if key.revoked or key.has_expired:
        raise ValueError(f"key {key_id} is revoked or expired")
    if not any(grant.rule().covers(scope, Operation.READ) for grant in key.grants.all()):
        raise ValueError(f"key {key_id} may not read {scope}")
    params = signing.sign(key_id, scope, exact=exact, expires=int(time.time()) + expires_in)
    return signing.query_string(params)
