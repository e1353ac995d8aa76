"""Services: bind a stream to a table (a sink), pause, resume and drop it, apply it now.

Binding checks everything that does not depend on the messages once, so that a running sink
only meets messages that do not fit (recorded) or a table changed under it (retried):
the stream is a JSON stream and not a fork, every mapped column exists with the mapped type,
the offset column is text, an upsert key has a unique index, and no NOT NULL column without a
default is left out of the mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, connection, transaction
from psycopg import sql

from streams.errors import BadRequest, Conflict, NotFound
from streams.models import Stream
from streams.protocol.headers import JSON, media_type
from streams.protocol.offsets import BEGINNING, NOW, parse
from tablesync import tables
from tablesync.mapping import ColumnMap, parse_column_maps
from tablesync.models import SinkMode, SinkState, StreamSink, TablePublication
from tablesync.publish import check_stream_path

DEFAULT_OFFSET_COLUMN = "stream_offset"
# The type of a created column whose mapping names none: any JSON value fits.
DEFAULT_TYPE = "jsonb"
TEXT_TYPES = frozenset({"text", "character varying"})


@dataclass(frozen=True)
class SinkSpec:
    """What an operator asks for (commands and the admin build one)."""

    stream: str
    table: str
    mapping: list[str]
    mode: str = SinkMode.APPEND
    # upsert: the key column, ``COLUMN[::TYPE]``; the entity type to apply (None: all).
    key: str | None = None
    entity_type: str | None = None
    offset_column: str | None = DEFAULT_OFFSET_COLUMN
    # Where to start: "-1" (the first message), "now" (the tail) or an offset.
    start: str = BEGINNING
    create_table: bool = False
    created_by: str = ""


def create_sink(spec: SinkSpec) -> StreamSink:
    """Bind ``spec.stream`` to ``spec.table``; the server processes start applying it at once."""
    path = check_stream_path(spec.stream)
    if spec.mode not in SinkMode.values:
        raise BadRequest(f"unknown mode {spec.mode!r} (append or upsert)")
    upsert = spec.mode == SinkMode.UPSERT
    maps = parse_column_maps(spec.mapping)
    key = parse_column_maps([spec.key])[0] if spec.key else None
    if upsert and key is None:
        raise BadRequest("an upsert sink needs a key column (--key)")
    if not upsert and (key is not None or spec.entity_type):
        raise BadRequest("a key column and an entity type are for upsert sinks")
    if not maps and spec.offset_column is None and not upsert:
        raise BadRequest("nothing to write: map at least one column")
    named = [m.column for m in maps] + [c for c in (spec.offset_column,) if c]
    named += [key.column] if key else []
    if len(set(named)) != len(named):
        raise BadRequest("the key, the offset column and the mapped columns must differ")
    with transaction.atomic():
        stream = _sinkable_stream(path)
        if spec.create_table:
            _create_table(spec, maps, key)
        table = tables.find_table(spec.table)
        mapping = [m.as_json(_column_type(table, m)) for m in maps]
        if key is not None:
            _column_type(table, key)
            if key.column not in table.unique_columns:
                raise BadRequest(f"{table.name}.{key.column} has no unique index of its own")
        if spec.offset_column is not None:
            _check_offset_column(table, spec.offset_column)
        _check_unmapped(table, set(named))
        seq, pos = _start(stream, spec.start)
        if StreamSink.objects.filter(stream=stream, table_oid=table.oid).exists():
            raise Conflict(f"stream {path!r} is already sunk into {table.name}")
        if TablePublication.objects.filter(stream=stream, table_oid=table.oid).exists():
            raise Conflict(
                f"{table.name} is published to {path!r}: sinking the stream into it would"
                " publish each row it writes again, without end"
            )
        return StreamSink.objects.create(
            stream=stream,
            stream_path=path,
            table_oid=table.oid,
            table_name=table.name,
            mode=spec.mode,
            mapping=mapping,
            key_column=key.column if key else None,
            entity_type=spec.entity_type or None,
            offset_column=spec.offset_column,
            applied_seq=seq,
            applied_pos=pos,
            created_by=spec.created_by,
        )


def _sinkable_stream(path: str) -> Stream:
    stream = Stream.objects.with_expired().filter(path=path).first()
    if stream is None or stream.expired or stream.deleted_at is not None:  # type: ignore[attr-defined]
        raise NotFound(f"stream {path!r} not found")
    if media_type(stream.content_type) != JSON:
        raise Conflict(f"stream {path!r} is {stream.content_type}, not application/json")
    if stream.fork_source_id is not None:
        raise Conflict(f"stream {path!r} is a fork: sink its source, or a stream of its own")
    return stream


def _start(stream: Stream, start: str) -> tuple[int, int]:
    if start == BEGINNING:
        return stream.first_seq, stream.first_pos
    if start == NOW:
        return stream.next_seq, stream.next_pos
    offset = parse(start)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT ds_is_position(s, %s, %s) FROM ds_stream AS s WHERE s.id = %s",
            [offset.seq, offset.pos, stream.pk],
        )
        if not cursor.fetchone()[0]:
            raise BadRequest(f"{start} is not an offset of stream {stream.path!r}")
    return offset.seq, offset.pos


def _resolve_type(name: str) -> str:
    """A type as PostgreSQL names it (format_type), parsed by PostgreSQL."""
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT format_type(%s::regtype, NULL)", [name])
            return str(cursor.fetchone()[0])
    except DatabaseError:
        raise BadRequest(f"unknown type {name!r}") from None


def _column_type(table: tables.Table, column_map: ColumnMap) -> str:
    column = table.columns.get(column_map.column)
    if column is None:
        raise BadRequest(f"{table.name} has no column {column_map.column!r}")
    if column_map.type is not None and _resolve_type(column_map.type) != column.type:
        raise BadRequest(
            f"{table.name}.{column.name} is {column.type}, the mapping says {column_map.type}"
        )
    return column.type


def _check_offset_column(table: tables.Table, name: str) -> None:
    column = table.columns.get(name)
    if column is None:
        raise BadRequest(
            f"{table.name} has no offset column {name!r} (add it as text, or sink without one)"
        )
    if column.type not in TEXT_TYPES:
        raise BadRequest(f"{table.name}.{name} is {column.type}: an offset column is text")


def _check_unmapped(table: tables.Table, written: set[str]) -> None:
    missing = [
        c.name
        for c in table.columns.values()
        if c.name not in written and c.not_null and not c.has_default
    ]
    if missing:
        raise BadRequest(
            f"{table.name}: column(s) {', '.join(missing)} are NOT NULL without a default and"
            " not mapped"
        )


def _create_table(spec: SinkSpec, maps: list[ColumnMap], key: ColumnMap | None) -> None:
    """CREATE TABLE for ``--create``: the mapped columns with their types (jsonb when none),
    the key (upsert: primary key) and the offset column (append: primary key)."""
    name = tables.parse_name(spec.table)
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [name.as_string()])
        if cursor.fetchone()[0] is not None:
            raise Conflict(f"table {spec.table!r} already exists (leave out --create)")
    columns: list[sql.Composable] = []
    if key is not None:
        columns.append(_column_sql(key, "text", "PRIMARY KEY"))
    columns += [_column_sql(m, DEFAULT_TYPE, "") for m in maps]
    if spec.offset_column is not None:
        columns.append(
            sql.SQL("{} text {}").format(
                sql.Identifier(spec.offset_column),
                sql.SQL("NOT NULL" if key is not None else "PRIMARY KEY"),
            )
        )
    # Identifiers quoted by psycopg; types as PostgreSQL itself names them (format_type).
    try:
        with transaction.atomic():
            tables.execute(
                sql.SQL("CREATE TABLE {} ({})").format(name, sql.SQL(", ").join(columns))
            )
    except DatabaseError as exc:
        raise BadRequest(f"cannot create {spec.table!r}: {str(exc).strip()}") from None


def _column_sql(column_map: ColumnMap, default_type: str, constraint: str) -> sql.Composable:
    type_name = _resolve_type(column_map.type) if column_map.type else default_type
    return sql.SQL("{} {} {}").format(
        sql.Identifier(column_map.column), sql.SQL(type_name), sql.SQL(constraint)
    )


def set_state(sink: StreamSink, state: SinkState) -> None:
    """Pause or resume a sink (a sink whose stream is gone stays so)."""
    if sink.state == SinkState.STREAM_GONE:
        raise Conflict("the sink's stream was deleted")
    StreamSink.objects.filter(pk=sink.pk).update(state=state)
    sink.state = state


def drop_sink(sink: StreamSink) -> None:
    """Remove a sink and its recorded errors; the table keeps its rows. Waits for a run in
    progress to end (the sink's row lock)."""
    with transaction.atomic():
        StreamSink.objects.select_for_update().filter(pk=sink.pk).first()
        sink.errors.all().delete()
        StreamSink.objects.filter(pk=sink.pk).delete()


def find_sink(stream: str, table: str) -> StreamSink:
    sink = StreamSink.objects.filter(stream_path=stream, table_name=table).first()
    if sink is None:
        target = tables.find_table(table)
        sink = StreamSink.objects.filter(stream_path=stream, table_oid=target.oid).first()
    if sink is None:
        raise NotFound(f"stream {stream!r} is not sunk into {table!r}")
    return sink


def run_sink_now(sink: StreamSink, *, batch: int = 2000) -> int:
    """Apply the sink up to its stream's tail from this process (commands); returns the
    messages consumed. Waits for a run of another process instead of skipping."""
    total = 0
    while True:
        with connection.cursor() as cursor:
            cursor.execute("SELECT ds_sink_run(%s, %s)", [sink.pk, batch])
            consumed = cursor.fetchone()[0]
        if consumed < 0:
            with transaction.atomic():
                StreamSink.objects.select_for_update().filter(pk=sink.pk).first()
            continue
        total += consumed
        if consumed < batch:
            return total


def describe(sink: StreamSink) -> dict[str, Any]:
    """A sink's configuration and progress, for commands."""
    tail = Stream.objects.filter(pk=sink.stream_id).values_list("next_seq", flat=True).first()
    return {
        "id": sink.pk,
        "stream": sink.stream_path,
        "table": sink.table_name,
        "mode": sink.mode,
        "state": sink.state,
        "applied_offset": sink.applied_offset,
        "behind": None if tail is None else tail - sink.applied_seq,
        "errors": sink.error_count,
        "last_error": sink.last_error,
    }
