"""Installs the SQL functions of every app that ships them (``AppConfig.sql_dir``).

Files run app by app, then in name order, all in one transaction: an app's files run after
those of the apps it names in ``sql_requires`` (and every app's after the streams app's), so an
app replaces the extension points the streams app declares (``ds_hook_*``) whatever the order
of ``INSTALLED_APPS``, and a server running during ``migrate`` never sees the no-op versions in
between.
"""

from __future__ import annotations

from pathlib import Path

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


def install_functions(using: str = "default") -> None:
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        for script in sql_scripts():
            cursor.execute(script.read_text())
