"""Sink mappings as operators write them (tablesync.mapping): no database."""

from __future__ import annotations

import pytest

from streams.errors import BadRequest
from tablesync.mapping import ColumnMap, parse_column_map, parse_column_maps


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("name", ColumnMap("name", ("name",))),
        ("name::text", ColumnMap("name", ("name",), "text")),
        ("amount=order.total::numeric", ColumnMap("amount", ("order", "total"), "numeric")),
        ("at=meta.at::timestamp with time zone",
         ColumnMap("at", ("meta", "at"), "timestamp with time zone")),
        ("Order Total=/order.v2/total", ColumnMap("Order Total", ("order.v2", "total"))),
        ("slash=/a~1b/c~0d", ColumnMap("slash", ("a/b", "c~d"))),
        ("price=price::numeric(10,2)", ColumnMap("price", ("price",), "numeric(10,2)")),
        ("  spaced = a.b :: int ", ColumnMap("spaced", ("a", "b"), "int")),
    ],
)  # fmt: skip
def test_column_maps(spec: str, expected: ColumnMap) -> None:
    assert parse_column_map(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "no column"),
        ("=field", "no column"),
        ("col=", "field is empty"),
        ("col=a..b", "empty key"),
        ("col=.a", "empty key"),
        ("col::", "type after '::' is empty"),
    ],
)
def test_bad_column_maps(spec: str, message: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_column_map(spec)
    assert message in refused.value.message


def test_a_column_is_mapped_once() -> None:
    with pytest.raises(BadRequest, match="mapped twice: a"):
        parse_column_maps(["a", "b=x", "a=y"])


def test_as_stored() -> None:
    assert ColumnMap("c", ("a", "b")).as_json("bigint") == {
        "column": "c", "path": ["a", "b"], "type": "bigint",
    }  # fmt: skip
