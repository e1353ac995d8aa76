from __future__ import annotations

from pathlib import Path
from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class StreamsConfig(AppConfig):
    name = "streams"
    verbose_name = "Durable streams"
    default_auto_field = "django.db.models.BigAutoField"
    # SQL functions of the write path, installed after every migrate (streams.store.schema).
    sql_dir = Path(__file__).resolve().parent / "store" / "sql"

    def ready(self) -> None:
        post_migrate.connect(_install_sql_functions, sender=self)


def _install_sql_functions(using: str = "default", **kwargs: Any) -> None:
    # SQL functions live in files, (re)installed after every migrate so the files are their
    # single source of truth (docs/decisions.md). post_migrate runs after all migrations.
    from streams.store.schema import install_functions

    install_functions(using)
