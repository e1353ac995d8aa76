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


def install_functions(using: str = "default") -> None:
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


async def verify_installed(conn: Any) -> None:
    """Refuse to run against a database whose SQL functions are not this code's (a deploy
    without ``migrate``, or a database migrated by another version): the write path's rules
    live in those functions. Also checks that the outcome types hold exactly the outcomes
    Python maps (streams.store.outcomes)."""
    from streams.store.outcomes import SQL_TYPES

    try:
        cur = await conn.execute("SELECT digest FROM ds_sql_install")
    except psycopg.errors.UndefinedTable:
        raise SchemaMismatch(
            "the database holds none of the server's tables: run `manage.py migrate`"
        ) from None
    row = await cur.fetchone()
    expected = digest()
    if row is None or row[0] != expected:
        found = row[0][:12] if row else "nothing"
        raise SchemaMismatch(
            f"the database's SQL functions ({found}) are not this code's ({expected[:12]}):"
            " run `manage.py migrate` with this version"
        )
    for type_name, outcomes in SQL_TYPES.items():
        cur = await conn.execute(f"SELECT enum_range(NULL::{type_name})::text[]")
        labels = (await cur.fetchone())[0]
        if set(labels) != {outcome.value for outcome in outcomes}:
            raise SchemaMismatch(
                f"{type_name} holds {sorted(labels)}, the code expects"
                f" {sorted(o.value for o in outcomes)}: run `manage.py migrate`"
            )
