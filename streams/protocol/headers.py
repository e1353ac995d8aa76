"""Request headers of the base protocol: TTL, expiry, closure, content types, producers.

Values come without the whitespace around them (``streams.http.request``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from streams.errors import BadRequest

# PROTOCOL.md 5.1: decimal, no sign, no leading zeros, no fraction or exponent.
_TTL_RE = re.compile(r"0|[1-9][0-9]*")
# Longer windows are refused rather than stored: 100 years is "never" for any real stream.
MAX_TTL_SECONDS = 100 * 365 * 24 * 3600
# RFC 3339 date-time: full date, "T" (or space is not allowed here), time, zone.
_RFC3339_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]{1,9})?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
# PROTOCOL.md 5.2.1: epochs and sequence numbers are integers in [0, 2^53 - 1].
MAX_SAFE_INTEGER = 2**53 - 1
_UINT_RE = re.compile(r"0|[1-9][0-9]{0,15}")
# RFC 9110 token, for the type and subtype of a media type.
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
# Whitespace around the type is HTTP OWS, space and tab only (RFC 9110 5.6.3): the store's
# ds_media_type (streams/store/sql/functions.sql) trims exactly these, and the two must agree.
_MEDIA_TYPE_RE = re.compile(rf"[ \t]*({_TOKEN})/({_TOKEN})[ \t]*(;.*)?", re.DOTALL)

# Bounds on header values the store keeps: a producer id is a key of the producer ledger's
# index (PostgreSQL refuses index rows over ~2.7 kB), a Stream-Seq and a Content-Type are
# stored with the stream. Longer values are refused with 400 before anything is written.
MAX_PRODUCER_ID_BYTES = 512
MAX_STREAM_SEQ_BYTES = 512
MAX_CONTENT_TYPE_BYTES = 256

DEFAULT_CONTENT_TYPE = "application/octet-stream"
JSON = "application/json"


def parse_ttl(value: str) -> int:
    if not _TTL_RE.fullmatch(value):
        raise BadRequest(f"Stream-TTL must be a non-negative integer, got {value[:32]!r}")
    if len(value) > 12 or int(value) > MAX_TTL_SECONDS:
        raise BadRequest(f"Stream-TTL may be at most {MAX_TTL_SECONDS} seconds")
    return int(value)


# Retention extension headers (docs/gaps.md, Retention): positive decimal integers, written
# like Stream-TTL. A maximum age is capped like a TTL; a size at 2^53 - 1 bytes.
RETENTION_MAX_AGE = "Stream-Retention-Max-Age"
RETENTION_MAX_BYTES = "Stream-Retention-Max-Bytes"
_POSITIVE_RE = re.compile(r"[1-9][0-9]*")


def parse_positive(name: str, value: str, limit: int) -> int:
    """A positive decimal integer header of at most ``limit`` (400 otherwise)."""
    if not _POSITIVE_RE.fullmatch(value):
        raise BadRequest(f"{name} must be a positive integer, got {value[:32]!r}")
    if len(value) > 16 or int(value) > limit:
        raise BadRequest(f"{name} may be at most {limit}")
    return int(value)


def parse_expires_at(value: str) -> datetime:
    match = _RFC3339_RE.fullmatch(value)
    if match is None:
        raise BadRequest(f"Stream-Expires-At must be an RFC 3339 timestamp, got {value[:64]!r}")
    text = match.group(0)
    fraction = match.group(7) or ""
    # datetime handles at most microseconds; drop finer digits rather than reject them.
    text = text.replace(fraction, fraction[:7]) if len(fraction) > 7 else text
    try:
        # In UTC, 9999-12-31T23:59:59-23:59 is past the last year datetime has (found by the
        # fuzzer: 500).
        return datetime.fromisoformat(text.upper().replace("Z", "+00:00")).astimezone(UTC)
    except (ValueError, OverflowError) as exc:
        raise BadRequest(f"Stream-Expires-At is not a valid date: {exc}") from None


def is_true(value: str | None) -> bool:
    """``Stream-Closed`` counts only when it is exactly ``true``, any case (PROTOCOL.md 4.1)."""
    return value is not None and value.lower() == "true"


def ascii_digits(text: str) -> bool:
    """Only ``0``-``9``: ``str.isdigit`` (and ``int``) also take other scripts' digits."""
    return text.isascii() and text.isdigit()


def bounded(name: str, value: str, limit: int) -> str:
    """``value`` unless it is longer than ``limit`` bytes (400)."""
    if len(value) > limit:
        raise BadRequest(f"{name} is longer than {limit} bytes")
    return value


def media_type(content_type: str) -> str:
    """The ``type/subtype`` of a Content-Type, lower-cased, parameters dropped; used to compare
    a request's type with a stream's (``application/json; charset=utf-8`` is JSON)."""
    bounded("Content-Type", content_type, MAX_CONTENT_TYPE_BYTES)
    match = _MEDIA_TYPE_RE.fullmatch(content_type)
    if match is None:
        raise BadRequest(f"malformed Content-Type {content_type[:100]!r}")
    return f"{match.group(1)}/{match.group(2)}".lower()


def is_json(stream_media_type: str) -> bool:
    return stream_media_type == JSON


def is_text_for_sse(stream_media_type: str) -> bool:
    """SSE carries ``text/*`` and JSON as UTF-8; everything else is base64 (PROTOCOL.md 5.8)."""
    return stream_media_type.startswith("text/") or stream_media_type == JSON


@dataclass(frozen=True, slots=True)
class ProducerTuple:
    producer_id: str
    epoch: int
    seq: int


def _producer_integer(name: str, value: str) -> int:
    if not _UINT_RE.fullmatch(value) or int(value) > MAX_SAFE_INTEGER:
        raise BadRequest(f"{name} must be an integer between 0 and 2^53-1, got {value[:32]!r}")
    return int(value)


def parse_producer(
    producer_id: str | None, epoch: str | None, seq: str | None
) -> ProducerTuple | None:
    """All three producer headers or none (PROTOCOL.md 5.2.1)."""
    given = [v is not None for v in (producer_id, epoch, seq)]
    if not any(given):
        return None
    if not all(given):
        raise BadRequest("Producer-Id, Producer-Epoch and Producer-Seq must be sent together")
    assert producer_id is not None and epoch is not None and seq is not None
    if producer_id == "":
        raise BadRequest("Producer-Id must not be empty")
    bounded("Producer-Id", producer_id, MAX_PRODUCER_ID_BYTES)
    return ProducerTuple(
        producer_id=producer_id,
        epoch=_producer_integer("Producer-Epoch", epoch),
        seq=_producer_integer("Producer-Seq", seq),
    )


@dataclass(frozen=True, slots=True)
class AppendHeaders:
    """What an append's headers ask for (PROTOCOL.md 5.2, 5.2.1)."""

    content_type: str | None
    close: bool
    producer: ProducerTuple | None
    stream_seq: str | None


def parse_append_headers(header: Callable[[str], str | None]) -> AppendHeaders:
    """The append headers, read through ``header(lower-case name)``."""
    stream_seq = header("stream-seq")
    return AppendHeaders(
        content_type=header("content-type"),
        close=is_true(header("stream-closed")),
        producer=parse_producer(
            header("producer-id"), header("producer-epoch"), header("producer-seq")
        ),
        stream_seq=None
        if stream_seq is None
        else bounded("Stream-Seq", stream_seq, MAX_STREAM_SEQ_BYTES),
    )
