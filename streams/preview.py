"""Human-readable previews of stored messages, for the admin and the console."""

from __future__ import annotations

import codecs
import json

from django.db.models import BinaryField, F, Func, Value

PREVIEW_CHARS = 2000
HEX_BYTES = 256
# What a preview reads of a message: messages may be up to DS_LIMITS__MAX_APPEND_BYTES each,
# and a page of them read whole held hundreds of MiB for a preview of 2,000 characters.
PREVIEW_BYTES = 64 * 1024


def stored_head(field: str, length: int = PREVIEW_BYTES) -> Func:
    """The first ``length`` bytes of a bytea column (PostgreSQL reads no more of a TOASTed
    value than that)."""
    return Func(F(field), Value(1), Value(length), function="substring", output_field=BinaryField())


def preview(data: bytes, stream_media_type: str, size: int | None = None) -> str:
    """Pretty JSON for JSON streams, text for text streams (or bytes that are clean UTF-8),
    hex otherwise. ``data`` may be the head of a message of ``size`` bytes (``PREVIEW_BYTES``
    read of it): then it is shown as text, a character cut at its end left out. Long values
    are cut, with a note of how many of the message's bytes are left out."""
    size = len(data) if size is None else size
    whole = len(data) >= size
    if stream_media_type == "application/json" and whole:
        try:
            pretty = json.dumps(json.loads(data), indent=2, ensure_ascii=False)
            if len(pretty) <= PREVIEW_CHARS:
                return pretty
            return f"{pretty[:PREVIEW_CHARS]} … (+{len(pretty) - PREVIEW_CHARS} characters)"
        except ValueError:
            pass
    text = _clean_text(data, whole)
    if stream_media_type.startswith("text/") or text is not None:
        if text is None:
            text = _decoder().decode(data, final=whole)
        return _cut(text, size)
    shown = data[:HEX_BYTES].hex(" ")
    rest = size - min(len(data), HEX_BYTES)
    return f"{shown} … (+{rest} bytes)" if rest > 0 else shown


def _decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _clean_text(data: bytes, whole: bool) -> str | None:
    """``data`` as text when it is clean UTF-8 (a character cut at the end of a head left
    out), else None."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
    except UnicodeDecodeError:
        return None
    clean = all(ch.isprintable() or ch in "\n\r\t" for ch in text[:PREVIEW_CHARS])
    return text if clean else None


def _cut(text: str, size: int) -> str:
    """``text`` (of a message of ``size`` bytes) up to ``PREVIEW_CHARS``, with how many of the
    message's bytes are not shown."""
    shown = text[:PREVIEW_CHARS]
    rest = size - len(shown.encode(errors="replace"))
    return f"{shown} … (+{rest} bytes)" if rest > 0 else shown
