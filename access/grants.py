"""Who may do what (PROTOCOL.md 12.1): principals, grants and the one authorization check.

Pure rules, no Django and no storage, so services call them at no cost and tests need
nothing to run them.

Resources are named by the URL path after ``/v1/``: ``stream/<path>`` for streams (their
State Protocol registrations and materialized state included), ``yjs/<service>/docs/<path>``
for Yjs documents and their awareness. A grant gives operations on every resource whose name
starts with its prefix (``stream/rooms/`` covers ``stream/rooms/42``; the empty prefix covers
everything), or on one resource exactly:

* ``read``: GET and HEAD, catch-up and live reads, state queries;
* ``append``: POST;
* ``manage``: PUT and DELETE (create, fork, delete), state registration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from streams.errors import Forbidden, Unauthorized

STREAM_RESOURCE = "stream/"


class Operation(StrEnum):
    READ = "read"
    APPEND = "append"
    MANAGE = "manage"


def stream_resource(path: str) -> str:
    return STREAM_RESOURCE + path


def doc_resource(service: str, doc_path: str) -> str:
    return f"yjs/{service}/docs/{doc_path}"


def normalize_prefix(prefix: str) -> str:
    """A grant's prefix as written by people: ``/v1/stream/rooms/`` and ``stream/rooms/`` are
    the same prefix."""
    return prefix.strip().removeprefix("/").removeprefix("v1/")


@dataclass(frozen=True, slots=True)
class Grant:
    prefix: str
    operations: frozenset[Operation]
    # One resource exactly (a signed URL for one stream), not everything under a prefix.
    exact: bool = False

    def covers(self, resource: str, operation: Operation) -> bool:
        if operation not in self.operations:
            return False
        return resource == self.prefix if self.exact else resource.startswith(self.prefix)

    @classmethod
    def parse(cls, text: str) -> Grant:
        """``PREFIX:op,op`` as given on the command line (``stream/rooms/:read,append``)."""
        prefix, sep, ops = text.rpartition(":")
        if not sep:
            raise ValueError(f"a grant is PREFIX:OPERATIONS, got {text!r}")
        try:
            operations = frozenset(Operation(op.strip()) for op in ops.split(",") if op.strip())
        except ValueError:
            raise ValueError(f"operations are read, append and manage, got {ops!r}") from None
        if not operations:
            raise ValueError(f"a grant needs at least one operation, got {text!r}")
        return cls(normalize_prefix(prefix), operations)

    def __str__(self) -> str:
        ops = ",".join(op.value for op in Operation if op in self.operations)
        return f"{self.prefix}{'' if self.exact else '*'}:{ops}"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking: ``kind`` and ``id`` name them in records (``key:AbCd1234``)."""

    kind: str
    id: str = ""
    name: str = ""
    grants: tuple[Grant, ...] = ()
    # Everything is allowed (the open mode, a Yjs service secret for its service is a grant).
    unrestricted: bool = False
    # Key of the rate limit this principal counts against, and its requests per second.
    rate_limit: float | None = field(default=None, compare=False)
    # When its credential stops being valid (Unix seconds: the expiry of a key or a signed
    # URL, a token's ``exp``); None when it does not by itself.
    expires_at: float | None = field(default=None, compare=False)

    @property
    def authenticated(self) -> bool:
        return self.kind not in ("anonymous", "open")

    @property
    def label(self) -> str | None:
        """What records of who did something store; None for nobody in particular."""
        return f"{self.kind}:{self.id}" if self.authenticated else None

    @property
    def holder(self) -> str | None:
        """Whose limits this principal's requests count against (a key's signed URLs count as
        the key: ``access.ratelimit``, ``streams.live_readers``); None for nobody in
        particular."""
        return f"key:{self.id}" if self.kind == "signed-url" else self.label

    def allows(self, resource: str, operation: Operation) -> bool:
        return self.unrestricted or any(g.covers(resource, operation) for g in self.grants)

    def require(self, resource: str, operation: Operation) -> None:
        """The authorization check: 401 without credentials, 403 outside the grants."""
        if self.allows(resource, operation):
            return
        if not self.authenticated:
            raise credentials_required()
        raise Forbidden(f"{self.label} may not {operation.value} {resource}")

    def readable_stream_prefixes(self) -> list[str] | None:
        """Stream paths this principal may read, as path prefixes (``""``: all), for listing
        catalogs; None when unrestricted."""
        if self.unrestricted:
            return None
        prefixes = []
        for grant in self.grants:
            if Operation.READ not in grant.operations or grant.exact:
                continue
            if STREAM_RESOURCE.startswith(grant.prefix) and not grant.exact:
                return [""]
            if grant.prefix.startswith(STREAM_RESOURCE):
                prefixes.append(grant.prefix[len(STREAM_RESOURCE) :])
        return prefixes


def credentials_required() -> Unauthorized:
    """The refusal of a request without credentials where they are needed."""
    return Unauthorized(
        "this server requires an API key: send Authorization: Bearer <key>",
        headers={"WWW-Authenticate": 'Bearer realm="durable-streams"'},
    )


ANONYMOUS = Principal("anonymous")
OPEN = Principal("open", unrestricted=True)
