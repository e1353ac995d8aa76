from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class StreamsConfig(AppConfig):
    name = "streams"
    verbose_name = "Durable streams"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        post_migrate.connect(_install_sql_functions, sender=self)


def _install_sql_functions(using: str = "default", **kwargs: Any) -> None:
    # The write path's functions live in one SQL file, (re)installed after every migrate so
    # the file is their single source of truth (docs/decisions.md).
    from streams.store.schema import install_functions

    install_functions(using)
