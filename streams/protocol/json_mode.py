"""JSON mode (PROTOCOL.md 9.1): validation, one-level array flattening, compact storage.

Each message is stored as compact JSON text, so a read is the stored rows joined by commas
inside ``[`` ``]`` with no re-encoding on the read path.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from streams.errors import BadRequest, PayloadTooLarge


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    # 1e400 is valid JSON but no double: it would come back as Infinity, which is not JSON.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


_decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)

# How deep a JSON body may nest (arrays and objects), as serde_json allows by default. Python's
# decoder stops near a thousand levels less the caller's own stack, so without a limit of its
# own a document was stored that the encoder, or a reader deeper in a stack (the state API's
# entities, in a Django thread), could not handle again: a 500 on every later read (probe 9c).
MAX_JSON_DEPTH = 128
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(set(range(256)) - set(b'[]{}"'))
_TOO_MANY_OPEN = b"[" * (MAX_JSON_DEPTH + 1)
_RUNS = re.compile(rb"\[+|\]+")
_OPEN = ord("[")


def _too_deep(body: bytes) -> bool:
    """Whether ``body`` (valid JSON) nests deeper than MAX_JSON_DEPTH, by its brackets outside
    strings; at C speed but for one walk over runs of brackets, in time linear in the body,
    and at once when it has too few brackets to."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return False
    # Escapes first (\\ before \"), then the quotes of strings without brackets: adjacent
    # quotes, however they pair, have no bracket between them.
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = text.translate(_BRACKETS, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in structure:  # strings holding brackets: drop them whole
        structure = b"".join(structure.split(b'"')[::2])
    if _TOO_MANY_OPEN in structure:
        return True
    # Passes take the innermost levels away while each takes much (most bodies end there); what
    # is left is measured in one walk over its runs of brackets. Passes alone cost a copy of
    # the body a level: a 64 MiB body of brackets took 13 s (review).
    passes = 0
    while structure:
        shorter = structure.replace(b"[]", b"")
        if len(shorter) > len(structure) * 3 // 4:
            break
        structure, passes = shorter, passes + 1
    runs = _RUNS.findall(structure)  # each level left is a run of "[" then one of "]"
    changes = (len(run) if run[0] == _OPEN else -len(run) for run in runs)
    return passes + max(accumulate(changes), default=0) > MAX_JSON_DEPTH


def _encode(value: Any) -> bytes:
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate escape ("\ud800") is valid JSON but not UTF-8: keep it escaped.
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def parse_body(body: bytes) -> Any:
    """Decode a request body as one JSON text (UTF-8, strict: no NaN or Infinity)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("JSON body is not valid UTF-8") from None
    text = text.removeprefix("\ufeff")
    too_deep = BadRequest(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        value, end = _decoder.raw_decode(text, _skip_whitespace(text, 0))
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    except RecursionError:  # Python's own limit, about a thousand levels less the stack's
        raise too_deep from None
    if _skip_whitespace(text, end) != len(text):
        raise BadRequest("invalid JSON: extra data after the value")
    # Judged once the body is known to be JSON: the walk costs less than the decoding did,
    # where a body that is no JSON may cost it alone (review: 3 s for 64 MiB of brackets
    # without commas, which the decoder refuses at once).
    if _too_deep(body):
        raise too_deep
    return value


def _skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\n\r":
        index += 1
    return index


def _flatten(value: Any, max_messages: int) -> tuple[list[Any], list[bytes]]:
    """The messages of a decoded body and their compact encodings: an array is flattened one
    level (PROTOCOL.md 9.1.2). More than ``max_messages`` is a 413, judged before the costly
    part (encoding each message)."""
    values = value if isinstance(value, list) else [value]
    if len(values) > max_messages:
        raise PayloadTooLarge(f"an append may hold at most {max_messages} JSON messages")
    return values, [_encode(item) for item in values]


def flatten_append(body: bytes, max_messages: int) -> tuple[list[Any], list[bytes]]:
    """The messages a POST stores, decoded and encoded; ``[]`` is a 400 (PROTOCOL.md 9.1.3)."""
    value = parse_body(body)
    if isinstance(value, list) and not value:
        raise BadRequest("an append must not be an empty JSON array")
    return _flatten(value, max_messages)


def messages_for_append(body: bytes, max_messages: int = 1 << 62) -> list[bytes]:
    return flatten_append(body, max_messages)[1]


def messages_for_create(body: bytes, max_messages: int = 1 << 62) -> list[bytes]:
    """The initial messages of a PUT: like an append, but ``[]`` or no body at all creates an
    empty stream (whitespace alone is not JSON: 400, as for an append)."""
    if not body:
        return []
    return _flatten(parse_body(body), max_messages)[1]


def render(payload: bytes) -> bytes:
    """A JSON read: the stored messages, already joined with commas, as one array."""
    return b"[" + payload + b"]"
