"""Human-readable previews of stored messages, for the admin and the console."""

from __future__ import annotations

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


def preview(data: bytes, stream_media_type: str) -> str:
    """Pretty JSON for JSON streams, text for text streams (or bytes that are clean UTF-8),
    hex otherwise. Long values are cut, with a note of how much is left out (of ``data``: the
    head of a message longer than ``PREVIEW_BYTES`` is shown as text)."""
    if stream_media_type == "application/json":
        try:
            return _cut(json.dumps(json.loads(data), indent=2, ensure_ascii=False))
        except ValueError:
            pass
    if stream_media_type.startswith("text/") or _is_clean_text(data):
        return _cut(data.decode("utf-8", errors="replace"))
    shown = data[:HEX_BYTES].hex(" ")
    rest = len(data) - HEX_BYTES
    return f"{shown} … (+{rest} bytes)" if rest > 0 else shown


def _is_clean_text(data: bytes) -> bool:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch in "\n\r\t" for ch in text[:PREVIEW_CHARS])


def _cut(text: str) -> str:
    if len(text) <= PREVIEW_CHARS:
        return text
    return f"{text[:PREVIEW_CHARS]} … (+{len(text) - PREVIEW_CHARS} characters)"
