"""Installs the SQL functions of every app that ships them (``AppConfig.sql_dir``).

Files run in app order (``INSTALLED_APPS``), then name order, all in one transaction: a later
app replaces the extension points an earlier one declares (``ds_hook_*``), and a server running
during ``migrate`` never sees the no-op versions in between.
"""

from __future__ import annotations

from pathlib import Path

from django.apps import apps
from django.db import connections, transaction


def sql_scripts() -> list[Path]:
    scripts: list[Path] = []
    for config in apps.get_app_configs():
        sql_dir = getattr(config, "sql_dir", None)
        if sql_dir is not None:
            scripts.extend(sorted(Path(sql_dir).glob("*.sql")))
    return scripts


def install_functions(using: str = "default") -> None:
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        for script in sql_scripts():
            cursor.execute(script.read_text())
