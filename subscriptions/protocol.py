"""Wire rules of subscriptions (PROTOCOL.md 6, 7): pure, no storage and no Django.

What a request body may hold and what it means: the normalized configuration of a
subscription and its hash (6.2), glob patterns and the regular expression the database matches
stream paths with, subscription ids, the bodies of callbacks, acks, releases and claims, and the
webhook retry schedule (7.1). Every refusal is a ``SubscriptionError`` carrying the code the
protocol names (``INVALID_REQUEST``, ``FENCED``...), rendered as ``{"error": {"code", ...}}``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from streams.errors import BadRequest, ProtocolError
from streams.http.request import check_stream_path
from streams.protocol.offsets import Offset
from streams.protocol.offsets import parse as parse_offset

WEBHOOK = "webhook"
PULL_WAKE = "pull-wake"
TYPES = (WEBHOOK, PULL_WAKE)

# PROTOCOL.md 6.2: lease_ttl_ms from 1 second to 10 minutes, 30 seconds by default.
MIN_LEASE_TTL_MS = 1_000
MAX_LEASE_TTL_MS = 600_000
DEFAULT_LEASE_TTL_MS = 30_000
# Bounds on what one configuration may hold (a body is also bounded in bytes by the endpoint).
MAX_EXPLICIT_STREAMS = 1_000
MAX_DESCRIPTION_CHARS = 1_000
MAX_URL_CHARS = 2_048
MAX_WORKER_CHARS = 256
MAX_ACKS = 10_000
# Subscription ids appear in URLs, resource names (access grants) and logs: a plain token.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~:@-]{0,127}")
_WAKE_ID_RE = re.compile(r"w_[0-9a-f]{32}")
# Characters a PostgreSQL regular expression (ARE) would read as operators: escaped with a
# backslash, which before any other ASCII punctuation means the character itself.
_ARE_SPECIAL = re.compile(r"([^A-Za-z0-9\u0080-\U0010ffff])")

# Retries of a failed webhook delivery (PROTOCOL.md 7.1): 1 s doubling to 60 s, +-20% jitter.
RETRY_FIRST_SECS = 1.0
RETRY_MAX_SECS = 60.0
RETRY_JITTER = 0.2


class SubscriptionError(ProtocolError):
    """A refusal with a subscription error code (PROTOCOL.md 6, 7), and any fields the
    protocol adds to the error object (``current_holder`` of ``ALREADY_CLAIMED``)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        fields: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, headers=headers)
        self.status = status
        self.code = code
        self.fields = fields or {}


def invalid(message: str) -> SubscriptionError:
    return SubscriptionError(400, "INVALID_REQUEST", message)


def not_found() -> SubscriptionError:
    return SubscriptionError(404, "SUBSCRIPTION_NOT_FOUND", "subscription not found")


def parse_subscription_id(text: str) -> str:
    if not _ID_RE.fullmatch(text):
        raise invalid(
            "a subscription id is 1 to 128 characters of letters, digits and . _ ~ : @ -,"
            " starting with a letter or digit"
        )
    return text


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (an empty body is an empty object)."""
    if not body.strip():
        return {}
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        raise invalid("the request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise invalid("the request body must be a JSON object")
    return value


def _text(value: Any, name: str, *, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"{name} must be a non-empty string")
    if len(value) > limit:
        raise invalid(f"{name} is longer than {limit} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{name} is not valid Unicode (a lone surrogate)") from None
    return value


def stream_path(value: Any, name: str = "a stream path") -> str:
    """A stream-root-relative path from a body (``events/abc``; PROTOCOL.md 6): the rules of
    stream URLs, leading and trailing slashes ignored."""
    text = _text(value, name, limit=4096).strip("/")
    try:
        return check_stream_path(text)
    except BadRequest as error:
        raise invalid(f"{name} {text[:100]!r}: {error.message}") from None


# -- glob patterns (PROTOCOL.md 6.2) ------------------------------------------------------------


def parse_pattern(value: Any) -> str:
    """A glob over stream paths: segments separated by ``/``, each literal, ``*`` (exactly one
    segment) or ``**`` (zero or more). A ``*`` inside a literal segment is refused rather than
    guessed at (docs/gaps.md)."""
    text = _text(value, "pattern", limit=1024).strip("/")
    for segment in text.split("/"):
        if segment in ("", ".", ".."):
            raise invalid("pattern has an empty, '.' or '..' segment")
        if "*" in segment and segment not in ("*", "**"):
            raise invalid(f"pattern segment {segment[:100]!r}: '*' and '**' must be whole segments")
    if text.split("/")[0] == "__ds":
        raise invalid("paths under '__ds' are reserved for protocol control APIs")
    if re.search(r"[\x00-\x1f\x7f]", text):
        raise invalid("pattern contains control characters")
    return text


def glob_regex(pattern: str) -> str:
    """A regular expression (valid for PostgreSQL and Python) matching ``'/' || path`` for
    exactly the stream paths the glob matches: each segment is ``/<segment>``, so ``**`` can
    stand for no segment at all."""
    parts = []
    for segment in pattern.split("/"):
        if segment == "**":
            parts.append("(?:/[^/]+)*")
        elif segment == "*":
            parts.append("/[^/]+")
        else:
            parts.append("/" + _ARE_SPECIAL.sub(r"\\\1", segment))
    return "^" + "".join(parts) + "$"


def glob_prefix(pattern: str) -> str:
    """The literal beginning every matching path shares (``events/`` of ``events/*/x``): what
    a principal must be allowed to read to subscribe to the pattern."""
    literal: list[str] = []
    for segment in pattern.split("/"):
        if segment in ("*", "**"):
            return "/".join(literal) + "/" if literal else ""
        literal.append(segment)
    return "/".join(literal)


def glob_matches(pattern: str, path: str) -> bool:
    return re.fullmatch(glob_regex(pattern), "/" + path) is not None


# -- the configuration (PROTOCOL.md 6.2) --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscriptionConfig:
    type: str
    pattern: str | None
    streams: tuple[str, ...]
    webhook_url: str | None
    wake_stream: str | None
    lease_ttl_ms: int
    description: str | None

    def canonical(self) -> dict[str, Any]:
        """What the hash covers (PROTOCOL.md 6.2): type, pattern, the streams deduplicated and
        sorted, the delivery configuration, lease_ttl_ms and description."""
        return {
            "type": self.type,
            "pattern": self.pattern,
            "streams": sorted(set(self.streams)),
            "webhook": {"url": self.webhook_url} if self.webhook_url is not None else None,
            "wake_stream": self.wake_stream,
            "lease_ttl_ms": self.lease_ttl_ms,
            "description": self.description,
        }

    def config_hash(self) -> str:
        canonical = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def readable_prefixes(self) -> list[str]:
        """Stream paths (prefixes) whose events the subscription would hand to its worker."""
        prefixes = []
        if self.pattern is not None:
            prefix = glob_prefix(self.pattern)
            prefixes.append(prefix)
            # `a/**` matches the stream `a` too (`**` may stand for no segment), which the
            # prefix `a/` does not cover.
            if prefix.endswith("/") and glob_matches(self.pattern, prefix[:-1]):
                prefixes.append(prefix[:-1])
        return prefixes + list(self.streams)


def parse_config(body: dict[str, Any]) -> SubscriptionConfig:
    """The configuration of a PUT (PROTOCOL.md 6.2). Fields the protocol does not name are
    ignored (docs/gaps.md)."""
    kind = body.get("type")
    if kind not in TYPES:
        raise invalid('type must be "webhook" or "pull-wake"')
    pattern = parse_pattern(body["pattern"]) if body.get("pattern") is not None else None
    streams_value = body.get("streams")
    if streams_value is None:
        streams: tuple[str, ...] = ()
    elif isinstance(streams_value, list):
        if len(streams_value) > MAX_EXPLICIT_STREAMS:
            raise invalid(f"streams may name at most {MAX_EXPLICIT_STREAMS} streams")
        streams = tuple(dict.fromkeys(stream_path(s, "a stream of streams") for s in streams_value))
    else:
        raise invalid("streams must be an array of stream paths")
    if pattern is None and not streams:
        raise invalid("at least one of pattern or streams is required")
    lease = body.get("lease_ttl_ms", DEFAULT_LEASE_TTL_MS)
    if (
        not isinstance(lease, int)
        or isinstance(lease, bool)
        or not MIN_LEASE_TTL_MS <= lease <= MAX_LEASE_TTL_MS
    ):
        raise invalid(
            f"lease_ttl_ms must be an integer from {MIN_LEASE_TTL_MS} to {MAX_LEASE_TTL_MS}"
        )
    description = body.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid("description must be a string")
        description = _text(description, "description", limit=MAX_DESCRIPTION_CHARS)
    webhook_url = wake_stream = None
    if kind == WEBHOOK:
        webhook = body.get("webhook")
        if not isinstance(webhook, dict) or "url" not in webhook:
            raise invalid("webhook subscriptions require webhook.url")
        webhook_url = _text(webhook["url"], "webhook.url", limit=MAX_URL_CHARS)
    else:
        if body.get("wake_stream") is None:
            raise invalid("pull-wake subscriptions require wake_stream")
        wake_stream = stream_path(body["wake_stream"], "wake_stream")
    return SubscriptionConfig(
        type=kind,
        pattern=pattern,
        streams=streams,
        webhook_url=webhook_url,
        wake_stream=wake_stream,
        lease_ttl_ms=lease,
        description=description,
    )


def parse_streams_body(body: dict[str, Any]) -> list[str]:
    """``{"streams": [...]}`` of an explicit membership change (PROTOCOL.md 6.4)."""
    value = body.get("streams")
    if not isinstance(value, list) or not value:
        raise invalid("streams must be a non-empty array of stream paths")
    if len(value) > MAX_EXPLICIT_STREAMS:
        raise invalid(f"streams may name at most {MAX_EXPLICIT_STREAMS} streams")
    return list(dict.fromkeys(stream_path(s, "a stream of streams") for s in value))


# -- wakes: callbacks, acks, releases, claims (PROTOCOL.md 7) -----------------------------------


# Generations are PostgreSQL bigints: a larger number is no generation (and no statement
# would take it).
MAX_GENERATION = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Ack:
    stream: str
    offset: Offset


@dataclass(frozen=True, slots=True)
class WakeReport:
    """The body of a callback, ack or release: which wake it is about, and what it acks."""

    wake_id: str
    generation: int
    acks: tuple[Ack, ...]
    done: bool


def parse_wake_report(body: dict[str, Any], *, acks_allowed: bool = True) -> WakeReport:
    wake_id = body.get("wake_id")
    generation = body.get("generation")
    if not isinstance(wake_id, str) or not wake_id:
        raise invalid("wake_id must be a non-empty string")
    if (
        not isinstance(generation, int)
        or isinstance(generation, bool)
        or not 0 <= generation <= MAX_GENERATION
    ):
        raise invalid(f"generation must be an integer from 0 to {MAX_GENERATION}")
    acks: list[Ack] = []
    raw_acks = body.get("acks") if acks_allowed else None
    if raw_acks is not None:
        if not isinstance(raw_acks, list):
            raise invalid("acks must be an array of {stream, offset}")
        if len(raw_acks) > MAX_ACKS:
            raise invalid(f"at most {MAX_ACKS} acks per request")
        for item in raw_acks:
            if not isinstance(item, dict):
                raise invalid("acks must be an array of {stream, offset}")
            path = stream_path(item.get("stream", item.get("path")), "an ack's stream")
            offset = item.get("offset")
            if not isinstance(offset, str):
                raise invalid("an ack's offset must be a string")
            try:
                acks.append(Ack(path, parse_offset(offset)))
            except BadRequest:
                raise SubscriptionError(
                    409, "INVALID_OFFSET", f"{offset[:64]!r} is not an offset of {path!r}"
                ) from None
    done = body.get("done", False)
    if not isinstance(done, bool):
        raise invalid("done must be true or false")
    # A wake id this server did not mint can only be stale: no need to look it up.
    if len(wake_id) > 64:
        raise invalid("wake_id is longer than 64 characters")
    return WakeReport(wake_id, generation, tuple(acks), done)


def is_wake_id(text: str) -> bool:
    return _WAKE_ID_RE.fullmatch(text) is not None


def parse_worker(body: dict[str, Any]) -> str:
    return _text(body.get("worker"), "worker", limit=MAX_WORKER_CHARS)


def retry_delay_secs(failures: int, jitter: float) -> float:
    """How long to wait before the next delivery attempt after ``failures`` failed ones in a
    row: 1 s, 2 s, 4 s... at most 60 s, times ``1 + jitter`` (``jitter`` in [-0.2, 0.2])."""
    base = min(RETRY_FIRST_SECS * 2 ** max(0, failures - 1), RETRY_MAX_SECS)
    return base * (1 + max(-RETRY_JITTER, min(RETRY_JITTER, jitter)))
