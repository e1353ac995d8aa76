from __future__ import annotations

from pathlib import Path

from django.apps import AppConfig


class SubscriptionsConfig(AppConfig):
    name = "subscriptions"
    verbose_name = "Subscriptions"
    default_auto_field = "django.db.models.BigAutoField"
    # Triggers on ds_stream (linking, waking) and the wake state machine (installed after the
    # streams SQL by streams.store.schema).
    sql_dir = Path(__file__).resolve().parent / "sql"
    sql_requires = ("streams",)

    def ready(self) -> None:
        from streams import lifecycle
        from streams.store import outcomes
        from subscriptions import delivery
        from subscriptions.outcomes import SubOutcome

        # Checked at start-up with the streams app's outcome types (streams.store.schema).
        outcomes.SQL_TYPES["ds_sub_outcome"] = SubOutcome
        delivery.listen_for_wakes()
        lifecycle.on_startup(delivery.ensure_started, delivery.stop)
