"""Human-readable previews of stored messages, for the admin."""

from __future__ import annotations

import json

PREVIEW_CHARS = 2000
HEX_BYTES = 256


def preview(data: bytes, stream_media_type: str) -> str:
    """Pretty JSON for JSON streams, text for text streams (or bytes that are clean UTF-8),
    hex otherwise. Long values are cut, with a note of how much is left out."""
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
