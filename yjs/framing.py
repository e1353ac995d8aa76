"""lib0 framing of Yjs updates (YJS-PROTOCOL.md 7): each update is written as a variable-length
unsigned integer (7 bits per byte, high bit = more bytes follow) with its length, then its
bytes. Clients frame on write; the server stores and returns the frames as they came."""

from __future__ import annotations


class FramingError(ValueError):
    """Bytes that are not a sequence of complete lib0 frames."""


class TooManyFrames(ValueError):
    """More frames than the caller takes."""


def write_var_uint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)
    return bytes(out)


def frame(update: bytes) -> bytes:
    return write_var_uint(len(update)) + update


def read_var_uint(data: bytes, index: int) -> tuple[int, int]:
    """The var-uint starting at ``data[index]`` and the index after it; FramingError when it
    is cut off or longer than 8 bytes."""
    value = 0
    shift = 0
    while True:
        if index >= len(data):
            raise FramingError("truncated length prefix")
        byte = data[index]
        index += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index
        shift += 7
        if shift > 49:  # lengths beyond 2^53 are not lengths of anything
            raise FramingError("length prefix too long")


def read_frames(data: bytes, limit: int | None = None) -> list[bytes]:
    """The updates of a lib0-framed body, each complete; FramingError otherwise, TooManyFrames
    as soon as there are more than ``limit``."""
    updates: list[bytes] = []
    index = 0
    end = len(data)
    while index < end:
        if limit is not None and len(updates) == limit:
            raise TooManyFrames(f"more than {limit} frames")
        length, index = read_var_uint(data, index)
        if index + length > end:
            raise FramingError(f"frame of {length} bytes runs past the end of the body")
        updates.append(data[index : index + length])
        index += length
    return updates
