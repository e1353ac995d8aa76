"""Services: publish a table to a stream, and unpublish it.

Publishing runs in one transaction that takes, in this order, the table's lock (SHARE ROW
EXCLUSIVE: writers wait, readers do not), then the stream's row lock, the order in which a
writer's commit takes them, so publishing cannot deadlock with writers. Within it the triggers
are created and the snapshot (if asked) is appended: no change can fall between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from django.conf import settings
from django.db import connection, transaction

from state.registry import REGISTRY_PATH
from streams.errors import BadRequest, Conflict, NotFound
from streams.http.request import stream_path
from streams.models import Stream
from streams.protocol.headers import JSON, media_type
from streams.store.outcomes import CREATE_SUCCESSES, CreateOutcome
from tablesync import tables
from tablesync.models import StreamSink, TablePublication


@dataclass(frozen=True)
class Published:
    publication: TablePublication
    created_stream: bool
    # Rows written as inserts by the snapshot (None: no snapshot).
    snapshot_rows: int | None


def check_stream_path(path: str) -> str:
    """The protocol's rules for a stream path (what /v1/stream/<path> accepts)."""
    checked = stream_path(quote(path, safe="/"))
    if checked == REGISTRY_PATH:
        raise BadRequest(f"{REGISTRY_PATH} is written by the server only")
    return checked


def publish_table(
    *,
    table: str,
    stream: str,
    entity_type: str | None = None,
    columns: list[str] | None = None,
    snapshot: bool = False,
    created_by: str = "",
) -> Published:
    """Append every committed change of ``table`` to the JSON stream ``stream`` (created when
    missing) as State Protocol change events of ``entity_type`` (the table's name by default),
    keyed by the primary key, with ``columns`` (all by default) as the value."""
    path = check_stream_path(stream)
    if entity_type is not None and not entity_type:
        raise BadRequest("the entity type cannot be empty")
    with transaction.atomic():
        target = tables.find_table(table)
        if not target.primary_key:
            raise BadRequest(f"{target.name} has no primary key: change events need a key")
        if columns is not None:
            unknown = [c for c in columns if c not in target.columns]
            if unknown or not columns:
                raise BadRequest(f"{target.name} has no column(s) {', '.join(map(repr, unknown))}")
            columns = list(dict.fromkeys(columns))
        tables.lock(target, "SHARE ROW EXCLUSIVE")
        _require_publishable(target)
        if TablePublication.objects.filter(table_oid=target.oid).exists():
            raise Conflict(f"{target.name} is already published")
        stream_row, created = _publishable_stream(path, created_by)
        if StreamSink.objects.filter(stream=stream_row, table_oid=target.oid).exists():
            raise Conflict(
                f"{path!r} is sunk into {target.name}: publishing the table to it would sink"
                " each change it publishes again, without end"
            )
        publication = TablePublication.objects.create(
            table_oid=target.oid,
            table_name=target.name,
            stream=stream_row,
            entity_type=entity_type or target.relname,
            key_columns=list(target.primary_key),
            columns=columns,
            max_stream_bytes=settings.DS_MAX_STREAM_BYTES,
            created_by=created_by,
        )
        rows: int | None = None
        with connection.cursor() as cursor:
            cursor.execute("SELECT ds_tablesync_attach(%s)", [publication.pk])
            if snapshot:
                cursor.execute("SELECT ds_tablesync_snapshot(%s)", [publication.pk])
                rows = cursor.fetchone()[0]
        if rows is not None:
            publication.snapshot_rows = rows
            publication.save(update_fields=["snapshot_rows"])
    return Published(publication, created, rows)


def _require_publishable(target: tables.Table) -> None:
    """What the publication's statement triggers cannot capture whole, refused: a partitioned
    table, a partition or a table in an inheritance tree (a statement's triggers are those of
    the table it names, so writes through a parent would be missed), a deferrable primary key
    (ds_tablesync_unfit in sql/tablesync.sql), a column whose values would become
    JSON through a cast a client may have written, and a schema where another role could put
    functions of its own (ds_tablesync_require_plain in sql/tablesync.sql): the triggers would
    run their code with the server's rights."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT ds_tablesync_unfit(c.oid, NULL), ds_tablesync_unplain_column(c.oid),"
            " ds_tablesync_schema_creator(), current_schema()"
            " FROM pg_class AS c WHERE c.oid = %s",
            [target.oid],
        )
        unfit, unplain, creator, schema = cursor.fetchone()
    if creator is not None:
        raise BadRequest(
            f"role {creator!r} may create objects in schema {schema!r}, where the publication's"
            " functions run with the server's rights: revoke CREATE on it from every role but"
            " the server's, or install the server in a schema of its own"
        )
    if unfit is not None:
        raise BadRequest(f"{target.name} cannot be published: {unfit} (docs/gaps.md)")
    if unplain is not None:
        raise BadRequest(
            f"column {unplain!r} of {target.name} has a type table sync cannot publish: an"
            " enum, a range or another type not built in (or one in an array or composite)"
            " becomes JSON through a cast its owner may write; use a built-in type, or a"
            " domain over one"
        )


def _publishable_stream(path: str, created_by: str) -> tuple[Stream, bool]:
    """The stream at ``path``, locked, or a new one (application/json, no TTL)."""
    created = False
    stream = Stream.objects.select_for_update().with_expired().filter(path=path).first()
    if stream is None or stream.expired:  # type: ignore[attr-defined]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT outcome FROM ds_create(%s, %s, NULL, NULL, false, '{}', %s,"
                " NULL, NULL, NULL, 0, %s, NULL, NULL)",
                [path, JSON, settings.DS_MAX_STREAM_BYTES, created_by or None],
            )
            outcome = CreateOutcome(cursor.fetchone()[0])
        if outcome not in CREATE_SUCCESSES:
            raise Conflict(f"stream {path!r} could not be created ({outcome})")
        stream = Stream.objects.select_for_update().get(path=path)
        created = outcome is CreateOutcome.CREATED
    if stream.deleted_at is not None:
        raise Conflict(f"stream {path!r} was deleted (it still has forks)")
    if media_type(stream.content_type) != JSON:
        raise Conflict(f"stream {path!r} is {stream.content_type}, not application/json")
    if stream.closed:
        raise Conflict(f"stream {path!r} is closed")
    if stream.ttl_seconds is not None or stream.expires_at is not None:
        raise Conflict(f"stream {path!r} expires (Stream-TTL or Stream-Expires-At)")
    if stream.retention_max_age is not None or stream.retention_max_bytes is not None:
        # Its readers need the snapshot and every change since (a probe's trimmed stream
        # materialized one row of five).
        raise Conflict(f"stream {path!r} has a retention policy: a published stream keeps all")
    if TablePublication.objects.filter(stream=stream).exists():
        raise Conflict(f"stream {path!r} is already the stream of a published table")
    return stream, created


def find_publication(table: str) -> TablePublication:
    """The publication of ``table``: the table of that name now, or a dropped table that was
    published under that name."""
    try:
        target: tables.Table | None = tables.find_table(table)
    except NotFound:
        target = None
    if target is not None:
        publication = TablePublication.objects.filter(table_oid=target.oid).first()
        if publication is not None:
            return publication
    for publication in TablePublication.objects.filter(table_name=table):
        if not table_exists(publication.table_oid):
            return publication
    raise NotFound(f"{table!r} is not published")


def table_exists(oid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_class WHERE oid = %s)", [oid])
        return bool(cursor.fetchone()[0])


def unpublish_table(*, table: str, close_stream: bool = False) -> TablePublication:
    """Stop publishing ``table``. Waits for transactions writing the table to end: each change
    committed before is in the stream, none after. ``close_stream`` also closes the stream, so
    readers see its end (PROTOCOL.md 5.2: Stream-Closed)."""
    with transaction.atomic():
        publication = find_publication(table)
        return unpublish(publication, close_stream=close_stream)


def unpublish(publication: TablePublication, *, close_stream: bool = False) -> TablePublication:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT ds_tablesync_detach(%s)", [publication.table_oid])
        TablePublication.objects.filter(pk=publication.pk).delete()
        if close_stream:
            cursor.execute(
                "SELECT a.outcome FROM ds_stream AS s,"
                " ds_append(s.path, '[[null, true, null, null, null, null, 0, 0, null]]',"
                "           '{}', '{}', ''::bytea, %s) AS a WHERE s.id = %s",
                [settings.DS_MAX_STREAM_BYTES, publication.stream_id],
            )
    return publication
