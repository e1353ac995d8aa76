"""Server-Sent Events framing (PROTOCOL.md 5.8)."""

from __future__ import annotations

import base64
import json
import re

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")
# Standard base64 lines of 76 characters (a multiple of 4), as MIME does.
_BASE64_LINE = 76


def data_event(payload: bytes, *, base64_encoded: bool) -> bytes:
    """One ``event: data``. Text is split on line breaks, each line its own ``data:`` field, so
    the client's join with ``\\n`` restores it (``\\r`` cannot survive SSE: docs/gaps.md)."""
    if base64_encoded:
        text = base64.b64encode(payload)
        lines = [text[i : i + _BASE64_LINE] for i in range(0, len(text), _BASE64_LINE)] or [b""]
    else:
        lines = _LINE_BREAK.split(payload)
    return b"event: data\n" + b"".join(_field(line) for line in lines) + b"\n"


def _field(line: bytes) -> bytes:
    # Clients strip one space after "data:". Lines are written without one (the conformance
    # suite pins `data:line`), except a line that starts with a space: it gets the separator
    # space so its own leading space survives.
    return (b"data: " if line[:1] == b" " else b"data:") + line + b"\n"


def control_event(
    *,
    next_offset: str,
    cursor: str | None,
    up_to_date: bool,
    closed: bool,
) -> bytes:
    control: dict[str, object] = {"streamNextOffset": next_offset}
    if cursor is not None and not closed:
        control["streamCursor"] = cursor
    if up_to_date or closed:
        control["upToDate"] = True
    if closed:
        control["streamClosed"] = True
    return b"event: control\ndata:" + json.dumps(control, separators=(",", ":")).encode() + b"\n\n"


COMMENT_KEEPALIVE = b": keep-alive\n\n"
