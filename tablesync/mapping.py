"""A sink's column mapping, as operators write it: ``COLUMN[=FIELD][::TYPE]``. No I/O.

* ``COLUMN`` is the table's column, as it is named (no SQL quoting: ``Order Total`` is that
  column);
* ``FIELD`` is where the value is in each message (in an upsert sink: in the event's
  ``value``): keys separated by dots (``user.name``), or a JSON Pointer (RFC 6901) for keys
  that contain dots (``/user.name/first``). Without it, the field named like the column;
* ``TYPE`` is the column's PostgreSQL type (``bigint``, ``timestamptz``, ``jsonb``...): checked
  against the table's, or used to create it (``--create``). Without it, the table's type (or
  ``jsonb`` for a table being created).

``amount=order.total::numeric`` maps ``{"order": {"total": 9.5}}`` to the column ``amount``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streams.errors import BadRequest

TYPE_SEPARATOR = "::"


@dataclass(frozen=True)
class ColumnMap:
    column: str
    path: tuple[str, ...]
    type: str | None = None

    def as_json(self, resolved_type: str) -> dict[str, Any]:
        """As stored in ``StreamSink.mapping`` (read by ``ds_sink_statement``)."""
        return {"column": self.column, "path": list(self.path), "type": resolved_type}


def parse_column_map(spec: str) -> ColumnMap:
    """``COLUMN[=FIELD][::TYPE]`` (see the module docstring)."""
    text = spec.strip()
    type_name: str | None = None
    if TYPE_SEPARATOR in text:
        text, type_name = text.rsplit(TYPE_SEPARATOR, 1)
        type_name = type_name.strip()
        if not type_name:
            raise BadRequest(f"mapping {spec!r}: the type after '::' is empty")
    column, sep, field = text.partition("=")
    column = column.strip()
    if not column:
        raise BadRequest(f"mapping {spec!r}: no column (expected COLUMN[=FIELD][::TYPE])")
    path = parse_field(field.strip() if sep else column, spec)
    return ColumnMap(column, path, type_name)


def parse_field(field: str, spec: str = "") -> tuple[str, ...]:
    """A field as a path of keys: ``a.b`` or the JSON Pointer ``/a/b``."""
    if not field:
        raise BadRequest(f"mapping {spec or field!r}: the field is empty")
    if field.startswith("/"):
        return tuple(part.replace("~1", "/").replace("~0", "~") for part in field[1:].split("/"))
    parts = tuple(field.split("."))
    if any(not part for part in parts):
        raise BadRequest(
            f"mapping {spec or field!r}: empty key in {field!r} (use a JSON Pointer, /a/b,"
            " for keys with dots)"
        )
    return parts


def parse_column_maps(specs: list[str]) -> list[ColumnMap]:
    """Several mappings; each column at most once."""
    maps = [parse_column_map(spec) for spec in specs]
    columns = [m.column for m in maps]
    duplicates = sorted({c for c in columns if columns.count(c) > 1})
    if duplicates:
        raise BadRequest(f"column(s) mapped twice: {', '.join(duplicates)}")
    return maps
