"""Template filters of the console. Each returns plain text: the template escapes it."""

from __future__ import annotations

import json
from typing import Any

from django import template

from streams.protocol.offsets import Offset

register = template.Library()


@register.filter
def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@register.filter
def offset(stream: Any) -> str:
    """A stream's tail offset."""
    return str(Offset(stream.next_seq, stream.next_pos))
