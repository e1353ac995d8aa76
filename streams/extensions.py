"""Extension points of the streams app, for apps built on it (the state app uses all three).

* An append validator: extra validation of JSON appends. It gets the stream path and the
  messages of one append, decoded and as they will be stored; it raises a ``ProtocolError``
  (400) to refuse the append, or returns the version of the rules it applied (None: the stream
  has no extra rules). The write
  path stores the append only if that version is still current, so an append can never slip
  past rules that changed while it was being validated. ``refresh`` asks the validator to
  reload its rules (after the write path reported them stale).
* Read-only paths: streams only the server writes; clients may read them, and get 403 for PUT,
  POST and DELETE.
* Append listeners: called in the server process after an append to a stream with extra
  rules has committed, with the stream's id (the state app materializes it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

AppendValidator = Callable[[str, list[Any], list[bytes], bool], Awaitable[int | None]]
AppendListener = Callable[[int], None]

_validator: AppendValidator | None = None
_listeners: list[AppendListener] = []
READ_ONLY_PATHS: set[str] = set()


def set_validator(validator: AppendValidator) -> None:
    global _validator
    _validator = validator


async def validate_json_append(
    path: str, values: list[Any], messages: list[bytes], *, refresh: bool
) -> int | None:
    if _validator is None:
        return None
    return await _validator(path, values, messages, refresh)


def add_append_listener(listener: AppendListener) -> None:
    _listeners.append(listener)


def appended(stream_id: int) -> None:
    for listener in _listeners:
        try:
            listener(stream_id)
        except Exception:  # a listener's failure must not fail the acknowledged append
            logger.exception("append listener failed for stream %s", stream_id)
