"""A human-readable view of a Yjs document's content, for the admin (decoded with pycrdt).

Root types are not recorded in updates: a root only has a type once someone reads it as one.
So each root is read, in a fresh Doc, as Text, Map, Array and XmlFragment in turn, and the
first reading that finds content is shown.
"""

from __future__ import annotations

import json
from typing import Any

from pycrdt import Array, Doc, Map, Text, XmlFragment

MAX_CHARS = 5000


def _read(update: bytes, name: str, kind: type) -> Any:
    doc: Doc[Any] = Doc()
    doc.apply_update(update)
    root = doc.get(name, type=kind)
    if kind is Map or kind is Array:
        return root.to_py() or None
    return str(root) or None


def describe(update: bytes) -> dict[str, str]:
    """{root name: its content as text}, for every root of the document."""
    names = _root_names(update) if update else []
    content: dict[str, str] = {}
    for name in names:
        for kind in (Text, Map, Array, XmlFragment):
            try:
                value = _read(update, name, kind)
            except Exception:  # noqa: BLE001 - a wrong guess of the root's type
                continue
            if value is not None:
                text = value if isinstance(value, str) else json.dumps(value, indent=2, default=str)
                content[f"{name} ({kind.__name__})"] = text[:MAX_CHARS]
                break
        else:
            content[name] = "(empty)"
    return content


def _root_names(update: bytes) -> list[str]:
    doc: Doc[Any] = Doc()
    doc.apply_update(update)
    return sorted(doc.keys())
