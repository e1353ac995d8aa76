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


@transaction.atomic
def create_key(
    *,
    name: str,
    grants: list[GrantRule],
    owner: str | None = None,
    expires_at: datetime | None = None,
    rate_limit: int | None = None,
) -> tuple[ApiKey, str]:
    """A new key and its plaintext (shown once: only its hash is stored)."""
    user = get_user_model().objects.get(username=owner) if owner else None
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
