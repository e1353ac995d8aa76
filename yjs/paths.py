"""Yjs URLs and the streams behind them (YJS-PROTOCOL.md 4, 5.6, 6, 12.2).

``/v1/yjs/<service>/docs/<doc path>`` maps to internal streams under the reserved ``__ds/``
prefix, which the base protocol endpoint refuses, so Yjs data can only be changed through the
Yjs endpoint:

* updates:   ``__ds/yjs/<service>/docs/<doc path>``
* awareness: ``__ds/yjs/<service>/awareness/<doc path>/<name>``
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from streams.errors import BadRequest
from streams.protocol.offsets import Offset, parse

ROUTE = "/v1/yjs/"
INTERNAL_PREFIX = "__ds/yjs/"
_SERVICE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DOC_SEGMENT = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_AWARENESS_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_DOC_PATH = 512
SNAPSHOT = "snapshot"
SNAPSHOT_SUFFIX = "_snapshot"


@dataclass(frozen=True, slots=True)
class DocRef:
    service: str
    doc_path: str

    @property
    def updates_stream(self) -> str:
        return f"{INTERNAL_PREFIX}{self.service}/docs/{self.doc_path}"

    def awareness_stream(self, name: str) -> str:
        return f"{self.awareness_prefix}{name}"

    @property
    def awareness_prefix(self) -> str:
        return f"{INTERNAL_PREFIX}{self.service}/awareness/{self.doc_path}/"


def parse_doc_url(raw_path: str) -> DocRef:
    """``/v1/yjs/<service>/docs/<doc path>`` as sent (percent-encoded). Doc paths are segments
    of letters, digits, ``_ - .`` joined by ``/``; ``.`` and ``..`` segments, also
    percent-encoded, and empty segments are refused (YJS-PROTOCOL.md 12.2)."""
    if not raw_path.startswith(ROUTE):
        raise BadRequest("not a Yjs URL")
    service, sep, rest = raw_path[len(ROUTE) :].partition("/docs/")
    if not sep or not _SERVICE.fullmatch(service):
        raise BadRequest("expected /v1/yjs/<service>/docs/<document path>")
    try:
        doc_path = unquote_to_bytes(rest).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("invalid document path") from None
    segments = doc_path.split("/")
    if (
        len(doc_path) > MAX_DOC_PATH
        or any(segment in (".", "..") for segment in segments)
        or not all(_DOC_SEGMENT.fullmatch(segment) for segment in segments)
    ):
        raise BadRequest("invalid document path")
    return DocRef(service, doc_path)


def parse_awareness_name(name: str) -> str:
    if not _AWARENESS_NAME.fullmatch(name):
        raise BadRequest("awareness names are 1-64 letters, digits, '_' or '-'")
    return name


def snapshot_key(covered: Offset) -> str:
    """A snapshot's offset token. The snapshot holds every update before ``covered`` (the
    tail when it was taken); its name is one byte before that, so that the client rule "next
    offset = snapshot offset with its last part plus one" lands exactly on ``covered``."""
    return f"{Offset(covered.seq, covered.pos - 1)}{SNAPSHOT_SUFFIX}"


def parse_snapshot_key(text: str) -> Offset:
    """The position a ``<offset>_snapshot`` token covers up to; BadRequest if malformed."""
    named = parse(text.removesuffix(SNAPSHOT_SUFFIX))
    return Offset(named.seq, named.pos + 1)
