"""Template filters of the console. Each returns plain text: the template escapes it."""

from __future__ import annotations

import json
from typing import Any

from django import template

from console.selectors import VALUE_PREVIEW_CHARS, doc_of_stream
from streams.protocol.offsets import Offset
from yjs.paths import DocRef

register = template.Library()


@register.filter
def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@register.filter
def entity_value(text: str) -> str:
    """An entity's value from the head of its JSON text (``selectors.VALUE_PREVIEW_CHARS``):
    indented when whole, else the head as it is, marked as cut."""
    if len(text) > VALUE_PREVIEW_CHARS:
        return text[:VALUE_PREVIEW_CHARS] + " \u2026 (cut)"
    return pretty_json(json.loads(text))


@register.filter
def offset(stream: Any) -> str:
    """A stream's tail offset."""
    return str(Offset(stream.next_seq, stream.next_pos))


@register.filter
def yjs_document(path: str) -> DocRef | None:
    """The Yjs document a stream holds the updates of, if any."""
    return doc_of_stream(path)
