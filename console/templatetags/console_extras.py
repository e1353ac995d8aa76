"""Template filters of the console. Each returns plain text: the template escapes it."""

from __future__ import annotations

import json
from typing import Any

from django import template

from console.selectors import VALUE_PREVIEW_BYTES, doc_of_stream
from streams.protocol.offsets import Offset
from yjs.paths import DocRef

register = template.Library()


@register.filter
def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@register.filter
def entity_value(entity: Any) -> str:
    """An entity's value, indented; one past ``selectors.VALUE_PREVIEW_BYTES`` (not read) by
    its size."""
    if entity.value_bytes > VALUE_PREVIEW_BYTES:
        return f"(a value of {entity.value_bytes:,} bytes: read it through the API)"
    return pretty_json(entity.shown)


@register.filter
def offset(stream: Any) -> str:
    """A stream's tail offset."""
    return str(Offset(stream.next_seq, stream.next_pos))


@register.filter
def yjs_document(path: str) -> DocRef | None:
    """The Yjs document a stream holds the updates of, if any."""
    return doc_of_stream(path)
