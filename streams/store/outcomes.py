"""The one vocabulary of write outcomes, shared by the SQL functions and Python.

Each write function (``sql/functions.sql``) returns one of these outcomes, typed in the
database as an ENUM of the same labels (migration ``0003_outcomes``): PostgreSQL refuses any
other value, and ``schema.verify_installed`` checks at start-up that its labels are exactly
these. Each outcome that refuses a request maps to its error here, in one table per write, so
a status is decided in one place: the SQL names what happened, this module says how the
protocol answers it.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from django.conf import settings

from streams.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    PayloadTooLarge,
    ProtocolError,
    StreamClosed,
    ValidationStale,
)


class CreateOutcome(StrEnum):
    CREATED = "created"
    EXISTS = "exists"
    CONFLICT = "conflict"
    SOURCE_NOT_FOUND = "source_not_found"
    SOURCE_GONE = "source_gone"
    CONTENT_TYPE_MISMATCH = "content_type_mismatch"
    FORK_OFFSET_INVALID = "fork_offset_invalid"
    SUB_OFFSET_INVALID = "sub_offset_invalid"
    TOO_LARGE = "too_large"
    FORK_OFFSET_GONE = "fork_offset_gone"
    FORK_TOO_DEEP = "fork_too_deep"


class AppendOutcome(StrEnum):
    APPENDED = "appended"
    DUPLICATE = "duplicate"
    ALREADY_CLOSED = "already_closed"
    NOT_FOUND = "not_found"
    GONE = "gone"
    STALE_EPOCH = "stale_epoch"
    EPOCH_SEQ_NOT_ZERO = "epoch_seq_not_zero"
    SEQUENCE_GAP = "sequence_gap"
    STREAM_CLOSED = "stream_closed"
    CONTENT_TYPE_MISMATCH = "content_type_mismatch"
    STREAM_SEQ_REGRESSION = "stream_seq_regression"
    TOO_LARGE = "too_large"
    VALIDATION_STALE = "validation_stale"


class TrimOutcome(StrEnum):
    TRIMMED = "trimmed"
    UNCHANGED = "unchanged"
    NOT_FOUND = "not_found"
    GONE = "gone"
    OFFSET_INVALID = "offset_invalid"
    KEEPS_HISTORY = "keeps_history"


class DeleteOutcome(StrEnum):
    DELETED = "deleted"
    SOFT_DELETED = "soft_deleted"
    NOT_FOUND = "not_found"
    GONE = "gone"


# The database's ENUM type of each vocabulary.
SQL_TYPES: dict[str, type[StrEnum]] = {
    "ds_create_outcome": CreateOutcome,
    "ds_append_outcome": AppendOutcome,
    "ds_delete_outcome": DeleteOutcome,
    "ds_trim_outcome": TrimOutcome,
}

CREATE_SUCCESSES = frozenset({CreateOutcome.CREATED, CreateOutcome.EXISTS})
APPEND_SUCCESSES = frozenset(
    {AppendOutcome.APPENDED, AppendOutcome.DUPLICATE, AppendOutcome.ALREADY_CLOSED}
)
DELETE_SUCCESSES = frozenset({DeleteOutcome.DELETED, DeleteOutcome.SOFT_DELETED})
TRIM_SUCCESSES = frozenset({TrimOutcome.TRIMMED, TrimOutcome.UNCHANGED})

CREATE_ERRORS: dict[CreateOutcome, Callable[[], ProtocolError]] = {
    CreateOutcome.CONFLICT: lambda: Conflict(
        "a stream already exists at this path with a different configuration"
    ),
    CreateOutcome.SOURCE_NOT_FOUND: lambda: NotFound("fork source stream not found"),
    CreateOutcome.SOURCE_GONE: lambda: Conflict("fork source stream was deleted"),
    CreateOutcome.CONTENT_TYPE_MISMATCH: lambda: Conflict(
        "Content-Type differs from the fork source's content type"
    ),
    CreateOutcome.FORK_OFFSET_INVALID: lambda: BadRequest(
        "Stream-Fork-Offset is not a position of the source stream"
    ),
    CreateOutcome.FORK_TOO_DEEP: lambda: BadRequest(
        f"the fork source is already {settings.DS_MAX_FORK_DEPTH} forks deep, as deep as"
        " forks may go (fork an earlier stream of its chain)"
    ),
    # The fork-offset-gone answer carries the source's start: built by the store
    # (writes.fork_offset_gone), which knows it.
    CreateOutcome.SUB_OFFSET_INVALID: lambda: BadRequest(
        "Stream-Fork-Sub-Offset is past the next message boundary"
    ),
    CreateOutcome.TOO_LARGE: lambda: PayloadTooLarge(
        "initial content exceeds the stream size limit"
    ),
}

DELETE_ERRORS: dict[DeleteOutcome, Callable[[], ProtocolError]] = {
    DeleteOutcome.NOT_FOUND: lambda: NotFound("stream not found"),
    DeleteOutcome.GONE: lambda: Gone("stream was deleted"),
}

TRIM_ERRORS: dict[TrimOutcome, Callable[[], ProtocolError]] = {
    TrimOutcome.NOT_FOUND: lambda: NotFound("stream not found"),
    TrimOutcome.GONE: lambda: Gone("stream was deleted"),
    TrimOutcome.OFFSET_INVALID: lambda: BadRequest(
        "Stream-Trim-Before is not a retained position of this stream"
    ),
    TrimOutcome.KEEPS_HISTORY: lambda: Conflict(
        "the stream keeps its whole history (its readers need all of it: a stream registered"
        " for the State Protocol compacts instead, a published table's stays whole)"
    ),
}


def append_error(
    outcome: AppendOutcome,
    *,
    tail: str | None,
    epoch: int | None,
    expected_seq: int | None,
    received_seq: int | None,
) -> ProtocolError:
    """The answer to a refused append, with the headers the protocol requires on it
    (PROTOCOL.md 5.2, 5.2.1)."""
    match outcome:
        case AppendOutcome.NOT_FOUND:
            return NotFound("stream not found")
        case AppendOutcome.GONE:
            return Gone("stream was deleted")
        case AppendOutcome.STALE_EPOCH:
            return Forbidden(
                "producer epoch is stale (fenced by a newer epoch)",
                headers={"Producer-Epoch": str(epoch)},
            )
        case AppendOutcome.EPOCH_SEQ_NOT_ZERO:
            return BadRequest("a new producer epoch must start at Producer-Seq 0")
        case AppendOutcome.SEQUENCE_GAP:
            return Conflict(
                "producer sequence gap",
                headers={
                    "Producer-Expected-Seq": str(expected_seq),
                    "Producer-Received-Seq": str(received_seq),
                },
            )
        case AppendOutcome.STREAM_CLOSED:
            assert tail is not None
            return StreamClosed(tail)
        case AppendOutcome.CONTENT_TYPE_MISMATCH:
            return Conflict("Content-Type does not match the stream's content type")
        case AppendOutcome.STREAM_SEQ_REGRESSION:
            return Conflict("Stream-Seq must be greater than the last one appended")
        case AppendOutcome.TOO_LARGE:
            return PayloadTooLarge("append would exceed the stream size limit")
        case AppendOutcome.VALIDATION_STALE:
            return ValidationStale()
    raise AssertionError(f"{outcome} is not a refusal")


def _complete() -> None:
    """Every outcome is a success or has its error: checked when the module loads."""
    for outcomes, successes, errors in (
        (CreateOutcome, CREATE_SUCCESSES | {CreateOutcome.FORK_OFFSET_GONE}, CREATE_ERRORS),
        (DeleteOutcome, DELETE_SUCCESSES, DELETE_ERRORS),
        (TrimOutcome, TRIM_SUCCESSES, TRIM_ERRORS),
    ):
        missing = set(outcomes) - set(successes) - set(errors)
        assert not missing, f"outcomes without an answer: {missing}"


_complete()
