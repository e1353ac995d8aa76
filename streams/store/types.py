"""Values passed between the HTTP layer and the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from streams.protocol.headers import ProducerTuple, is_json
from streams.protocol.offsets import ZERO, Offset


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows of ``stream_id`` with ``lo <= seq < hi`` (``hi`` None: up to the tail)."""

    stream_id: int
    lo: int
    hi: int | None


@dataclass(frozen=True, slots=True)
class Retention:
    """A retention policy (docs/gaps.md, Retention): messages older than ``max_age`` seconds,
    and those before the newest ``max_bytes`` bytes, are trimmed. None: no limit."""

    max_age: int | None = None
    max_bytes: int | None = None

    def __bool__(self) -> bool:
        return self.max_age is not None or self.max_bytes is not None


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """A stream as one statement saw it: everything a handler needs to answer."""

    id: int
    path: str
    content_type: str
    # content_type's media type by the store's rule (ds_media_type), which judges appends.
    media_type: str
    tail: Offset
    closed: bool
    ttl_seconds: int | None
    expires_at: datetime | None
    # Segments from the stream itself down its fork chain (one segment when not a fork).
    segments: tuple[Segment, ...]
    # The earliest retained position: `offset=-1` reads from here, earlier offsets are gone.
    start: Offset = ZERO
    # Explicit offsets below this seq (but the start) are gone: compaction dropped a delete
    # event after them (state/compaction.py).
    resume_seq: int = 0
    # Below this seq, compaction may have left gaps between the stored messages.
    compacted_seq: int = 0
    # The stream's own retention policy (the server-wide default is not included).
    retention: Retention = Retention()

    @property
    def is_json(self) -> bool:
        return is_json(self.media_type)

    def gone(self, offset: Offset) -> bool:
        """Is ``offset`` before what this stream retains (PROTOCOL.md 5.6: 410 Gone)?"""
        return offset < self.start or (offset.seq < self.resume_seq and offset != self.start)


@dataclass(frozen=True, slots=True)
class ReadResult:
    # The messages read, as pieces whose concatenation is the payload: the messages
    # concatenated, or for JSON joined with commas (the body is this in brackets:
    # streams.protocol.json_mode). Pieces, so a large read is joined only into the blocks
    # it is sent in (streams.http.responses); a large message may be a memoryview of the
    # database's result (streams.store.reads: not copied once more).
    parts: tuple[bytes | memoryview, ...]
    count: int
    start: Offset
    next_offset: Offset
    # True when the read reached the tail the stream had when it was read.
    up_to_date: bool
    closed_at_tail: bool

    @property
    def payload(self) -> bytes:
        if len(self.parts) == 1 and isinstance(self.parts[0], bytes):
            return self.parts[0]
        return b"".join(self.parts)

    @property
    def size(self) -> int:
        return sum(len(part) for part in self.parts)


@dataclass(frozen=True, slots=True)
class ForkSpec:
    source_path: str
    # None: the source's tail.
    offset: Offset | None
    sub_offset: int = 0


@dataclass(frozen=True, slots=True)
class CreateRequest:
    path: str
    content_type: str | None
    ttl_seconds: int | None
    expires_at: datetime | None
    closed: bool
    messages: list[bytes]
    fork: ForkSpec | None = None
    # Who creates it (``access.grants.Principal.label``), recorded with the stream.
    created_by: str | None = None
    # Its own retention policy; None: none (a fork then inherits its source's).
    retention: Retention | None = None


@dataclass(frozen=True, slots=True)
class CreateResult:
    created: bool
    stream_id: int
    content_type: str
    tail: Offset
    closed: bool


@dataclass(slots=True)
class AppendRequest:
    path: str
    # Media type of the body; None when the body is empty (close-only).
    media_type: str | None
    messages: list[bytes]
    close: bool = False
    producer: ProducerTuple | None = None
    stream_seq: str | None = None
    # Version of the extra validation the messages passed (streams.extensions), or None.
    validation_version: int | None = None
    size: int = field(init=False)
    # When group commit queued it (time.monotonic()): it waits the lock timeout at most.
    queued_at: float = field(default=0.0, init=False, compare=False)

    def __post_init__(self) -> None:
        self.size = sum(len(m) for m in self.messages)


@dataclass(frozen=True, slots=True)
class AppendResult:
    """The outcome of one append. Refusals are raised as ProtocolErrors by the store, so a
    result is always a success: new data, a close, or an idempotent duplicate."""

    stream_id: int
    next_offset: Offset
    closed: bool
    duplicate: bool
    producer_epoch: int | None
    producer_seq: int | None


@dataclass(frozen=True, slots=True)
class TrimResult:
    """After a trim: where the stream starts and its tail; ``trimmed`` False when it already
    started at or after the offset asked for."""

    trimmed: bool
    start: Offset
    tail: Offset
