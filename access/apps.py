from __future__ import annotations

from pathlib import Path

from django.apps import AppConfig


class AccessConfig(AppConfig):
    name = "access"
    verbose_name = "Access control"
    default_auto_field = "django.db.models.BigAutoField"
    # Triggers that tell every server process when keys change (access.auth's caches).
    sql_dir = Path(__file__).resolve().parent / "sql"
    sql_requires = ("streams",)

    def ready(self) -> None:
        from access import auth

        auth.listen_for_changes()
