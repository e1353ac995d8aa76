"""Offsets (PROTOCOL.md 8).

A position is ``(seq, pos)``: the number of messages and of bytes before it. It is written as
``{seq:016d}_{pos:016d}``, so offsets of one stream sort lexically in stream order, never contain
``, & = ? /`` and are never the sentinels ``-1`` or ``now``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from streams.errors import BadRequest

WIDTH = 16
# ASCII digits only: `\d` (and int()) would also take other scripts' digits.
_OFFSET_RE = re.compile(r"([0-9]{16})_([0-9]{16})")

BEGINNING = "-1"
NOW = "now"


@dataclass(frozen=True, order=True, slots=True)
class Offset:
    seq: int
    pos: int

    def __str__(self) -> str:
        return f"{self.seq:0{WIDTH}d}_{self.pos:0{WIDTH}d}"


ZERO = Offset(0, 0)


def parse(text: str) -> Offset:
    """Parse a concrete offset minted by this server; anything else is a 400."""
    match = _OFFSET_RE.fullmatch(text)
    if match is None:
        raise BadRequest(f"malformed offset {text[:64]!r}")
    return Offset(int(match.group(1)), int(match.group(2)))


@dataclass(frozen=True, slots=True)
class ReadStart:
    """Where a read starts: the beginning (``-1``: the stream's earliest retained position,
    which trimming moves), the tail (``now``), or a concrete offset."""

    offset: Offset | None = None
    at_tail: bool = False

    @property
    def beginning(self) -> bool:
        return self.offset is None and not self.at_tail


def parse_read_offset(values: list[str]) -> ReadStart:
    """The ``offset`` query parameter of a read (PROTOCOL.md 5.6, 8)."""
    if not values:
        return ReadStart()
    if len(values) > 1:
        raise BadRequest("offset given more than once")
    text = values[0]
    if text == BEGINNING:
        return ReadStart()
    if text == NOW:
        return ReadStart(at_tail=True)
    return ReadStart(parse(text))
