"""Installs the SQL functions of every app that ships them (``AppConfig.sql_dir``).

Files run app by app, then in name order, all in one transaction: an app's files run after
those of the apps it names in ``sql_requires`` (and every app's after the streams app's), so an
app replaces the extension points the streams app declares (``ds_hook_*``) whatever the order
of ``INSTALLED_APPS``, and a server running during ``migrate`` never sees the no-op versions in
between.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import psycopg
from django.apps import AppConfig, apps
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError
from django.db import connections, transaction


def sql_scripts() -> list[Path]:
    scripts: list[Path] = []
    for config in _in_dependency_order([c for c in apps.get_app_configs() if _sql_dir(c)]):
        scripts.extend(sorted(_sql_dir(config).glob("*.sql")))  # type: ignore[union-attr]
    return scripts


def _sql_dir(config: AppConfig) -> Path | None:
    sql_dir = getattr(config, "sql_dir", None)
    return Path(sql_dir) if sql_dir is not None else None


def _in_dependency_order(configs: list[AppConfig]) -> list[AppConfig]:
    by_label = {config.label: config for config in configs}
    ordered: list[AppConfig] = []

    def visit(config: AppConfig, path: tuple[str, ...]) -> None:
        if config in ordered:
            return
        if config.label in path:
            raise ImproperlyConfigured(f"sql_requires cycle: {' -> '.join(path)}")
        requires = set(getattr(config, "sql_requires", ()))
        if config.label != "streams":
            requires.add("streams")
        for label in sorted(requires):
            if label in by_label:
                visit(by_label[label], (*path, config.label))
        ordered.append(config)

    for config in configs:
        visit(config, ())
    return ordered


def digest() -> str:
    """What the SQL of this code is: a SHA-256 of every script, in install order."""
    hasher = hashlib.sha256()
    for script in sql_scripts():
        hasher.update(script.name.encode() + b"\0" + script.read_bytes() + b"\0")
    return hasher.hexdigest()


def unknown_migrations(applied: set[tuple[str, str]]) -> list[str]:
    """Of the migrations ``applied`` to a database, those of this code's apps that this code
    does not have: the database was migrated by a newer version."""
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    ours = {label for label, _ in loader.disk_migrations}
    return sorted(
        f"{label}.{name}"
        for label, name in applied
        if label in ours and (label, name) not in loader.disk_migrations
    )


def install_functions(using: str = "default") -> None:
    """Install this code's SQL, unless the database was migrated by a newer version: an older
    version's ``migrate`` (a rollback, or what its refusal to start advised) replaced the SQL
    under the newer servers running, which went on serving with it (probe 10u: a state
    stream's trim deleted its history again, the fix of the newer version undone)."""
    from django.db.migrations.recorder import MigrationRecorder

    applied = set(MigrationRecorder(connections[using]).applied_migrations())
    newer = unknown_migrations(applied)
    if newer:
        raise CommandError(
            f"the database was migrated by a newer version of the server ({', '.join(newer)}"
            " unknown here): its SQL is left as it is; run that version, or restore a backup"
            " taken before it"
        )
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        for script in sql_scripts():
            cursor.execute(script.read_text())
        cursor.execute(
            "INSERT INTO ds_sql_install (digest) VALUES (%s)"
            " ON CONFLICT (id) DO UPDATE SET digest = excluded.digest, installed_at = now()",
            [digest()],
        )


class SchemaMismatch(ImproperlyConfigured):
    pass


async def verify_installed(conn: Any, expected: str | None = None) -> None:
    """Refuse to run against a database whose SQL functions are not this code's (a deploy
    without ``migrate``, or a database migrated by another version): the write path's rules
    live in those functions. Also checks that the outcome types hold exactly the outcomes
    Python maps (streams.store.outcomes). ``expected``: the digest of the SQL the process
    started with (else of the files on disk now: a deploy may have replaced them since)."""
    from streams.store.outcomes import SQL_TYPES

    try:
        cur = await conn.execute("SELECT digest FROM ds_sql_install")
    except psycopg.errors.UndefinedTable:
        raise SchemaMismatch(
            "the database holds none of the server's tables: run `manage.py migrate`"
        ) from None
    row = await cur.fetchone()
    expected = expected or digest()
    if row is None or row[0] != expected:
        found = row[0][:12] if row else "nothing"
        cur = await conn.execute("SELECT app, name FROM django_migrations")
        newer = unknown_migrations({(app, name) for app, name in await cur.fetchall()})
        advice = (
            f"the database was migrated by a newer version ({', '.join(newer)} unknown here):"
            " run that version"
            if newer
            else "run `manage.py migrate` with this version"
        )
        raise SchemaMismatch(
            f"the database's SQL functions ({found}) are not this code's ({expected[:12]}):"
            f" {advice}"
        )
    for type_name, outcomes in SQL_TYPES.items():
        cur = await conn.execute(f"SELECT enum_range(NULL::{type_name})::text[]")
        labels = (await cur.fetchone())[0]
        if set(labels) != {outcome.value for outcome in outcomes}:
            raise SchemaMismatch(
                f"{type_name} holds {sorted(labels)}, the code expects"
                f" {sorted(o.value for o in outcomes)}: run `manage.py migrate`"
            )
