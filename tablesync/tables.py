"""What the database says about an operator's table, and how to name it safely.

A table is named by an operator as a Django model (``app_label.ModelName``) or as a PostgreSQL
table name, optionally schema-qualified and quoted as in SQL (``orders``, ``sales.orders``,
``"Sales"."Order Lines"``). PostgreSQL itself parses the name (``to_regclass``); the table is
then known by its oid, and SQL naming it is composed with ``psycopg.sql.Identifier`` (here) or
``format('%I')`` / ``regclass`` (in ``sql/tablesync.sql``), never by interpolating text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from django.apps import apps
from django.db import DatabaseError, connection, transaction
from psycopg import sql

from streams.errors import BadRequest, NotFound

# The server's own tables are never published or sunk into (publishing ds_message would append
# to itself).
RESERVED_PREFIX = "ds_"
# The apps whose tables are the server's own, beside ds_*: Django's sessions, users and rights
# (a session key read from a stream signs its reader in as that user; a row sunk into auth_user
# makes one), the admin's log, the API-key library's table, Yjs documents... Never published nor
# sunk into: their rows are written by the server alone, and read by those it lets read them.
SERVER_APPS = (
    "admin", "auth", "contenttypes", "sessions", "rest_framework_api_key",
    "streams", "access", "state", "yjs", "spark", "subscriptions", "console", "tablesync",
)  # fmt: skip


@functools.cache
def server_tables() -> dict[str, str]:
    """The server's own tables (``SERVER_APPS``'), each with its app's label; and Django's
    record of migrations."""
    tables = {"django_migrations": "migrations"}
    for config in apps.get_app_configs():
        if config.label in SERVER_APPS:
            for model in config.get_models(include_auto_created=True):
                tables[model._meta.db_table] = config.label
    return tables


@dataclass(frozen=True)
class Column:
    name: str
    # The type without modifiers, as PostgreSQL names it (format_type): "character varying".
    type: str
    not_null: bool
    has_default: bool


@dataclass(frozen=True)
class Table:
    oid: int
    # As PostgreSQL quotes it (regclass::text): "orders", "sales.orders", "\"Order Lines\"".
    name: str
    schema: str
    relname: str
    primary_key: tuple[str, ...]
    columns: dict[str, Column]
    # Single columns with a unique, non-partial index (upsert sinks' keys).
    unique_columns: frozenset[str]

    @property
    def identifier(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.relname)


def sql_name(name: str) -> str:
    """The SQL name of a table given as a Django model label or a table name."""
    if name.count(".") == 1 and not name.startswith('"'):
        app_label, model_name = name.split(".")
        try:
            model = apps.get_model(app_label, model_name)
        except (LookupError, ValueError):
            return name
        return sql.Identifier(model._meta.db_table).as_string()
    return name


def find_table(name: str) -> Table:
    """The table named ``name`` (a model label or an SQL table name); NotFound when there is
    none, BadRequest for what cannot be published or sunk into."""
    target = sql_name(name)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass(%s)::oid", [target])
            oid = cursor.fetchone()[0]
    except DatabaseError:  # PostgreSQL could not parse the name
        raise BadRequest(f"{name!r} is not a valid table name") from None
    if oid is None:
        raise NotFound(f"table {name!r} not found")
    return table_by_oid(oid, name)


def table_by_oid(oid: int, name: str | None = None) -> Table:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.oid::regclass::text, n.nspname, c.relname, c.relkind"
            " FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
            " WHERE c.oid = %s",
            [oid],
        )
        row = cursor.fetchone()
        if row is None:
            raise NotFound(f"table {name or oid!r} not found")
        qualified, schema, relname, kind = row
        if kind not in ("r", "p"):
            raise BadRequest(f"{qualified} is not a table")
        if schema in ("pg_catalog", "information_schema") or relname.startswith(RESERVED_PREFIX):
            raise BadRequest(f"{qualified} is one of the server's or PostgreSQL's own tables")
        if (label := server_tables().get(relname)) is not None:
            raise BadRequest(
                f"{qualified} is one of the server's own tables ({label}): published, its"
                " stream would show the server's records (credentials among them) to its"
                " readers; sunk into, its writers would write them"
            )
        cursor.execute(
            "SELECT a.attname FROM pg_index AS i"
            " CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)"
            " JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
            " WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.ord",
            [oid],
        )
        primary_key = tuple(r[0] for r in cursor.fetchall())
        cursor.execute(
            "SELECT a.attname, format_type(a.atttypid, NULL), a.attnotnull,"
            "       a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> ''"
            " FROM pg_attribute AS a"
            " WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            [oid],
        )
        columns = {r[0]: Column(r[0], r[1], r[2], r[3]) for r in cursor.fetchall()}
        cursor.execute(
            "SELECT a.attname FROM pg_index AS i"
            " JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]"
            " WHERE i.indrelid = %s AND i.indisunique AND i.indnkeyatts = 1"
            "   AND i.indpred IS NULL AND i.indexprs IS NULL",
            [oid],
        )
        unique = frozenset(r[0] for r in cursor.fetchall())
    return Table(oid, qualified, schema, relname, primary_key, columns, unique)


def parse_name(name: str) -> sql.Identifier:
    """A table name (model label or SQL name) as an identifier, split by PostgreSQL
    (``parse_ident``: schema and table, quotes honoured)."""
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT parse_ident(%s)", [sql_name(name)])
            parts = cursor.fetchone()[0]
    except DatabaseError:
        raise BadRequest(f"{name!r} is not a valid table name") from None
    if not 1 <= len(parts) <= 2:
        raise BadRequest(f"{name!r}: expected a table or schema.table")
    if parts[-1].startswith(RESERVED_PREFIX):
        raise BadRequest(f"table names starting with {RESERVED_PREFIX} are the server's own")
    return sql.Identifier(*parts)


def lock(table: Table, mode: str) -> None:
    """LOCK TABLE in ``mode`` (a constant of the caller's) until the transaction ends."""
    statement = sql.SQL("LOCK TABLE {} IN {} MODE").format(table.identifier, sql.SQL(mode))
    execute(statement)


def execute(statement: sql.Composable) -> None:
    """Run composed SQL on Django's connection (rendered with its own quoting rules)."""
    raw = connection.connection
    assert raw is not None
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(raw))
