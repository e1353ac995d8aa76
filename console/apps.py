from __future__ import annotations

from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Stream console"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from console import keys, rates
        from streams import lifecycle

        lifecycle.on_startup(rates.ensure_started, rates.stop)
        keys.revoke_with_their_users()
