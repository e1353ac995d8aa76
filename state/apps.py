from __future__ import annotations

from pathlib import Path

from django.apps import AppConfig


class StateConfig(AppConfig):
    name = "state"
    verbose_name = "State Protocol"
    default_auto_field = "django.db.models.BigAutoField"
    # Materialization and __registry__ recording, replacing the streams app's ds_hook_* no-ops
    # (installed after the streams SQL by streams.store.schema).
    sql_dir = Path(__file__).resolve().parent / "sql"
    sql_requires = ("streams",)

    def ready(self) -> None:
        from state import compaction, live
        from state.registry import REGISTRY_PATH
        from state.validation import validate_state_append
        from streams import extensions, lifecycle

        extensions.set_validator(validate_state_append)
        extensions.add_append_listener(live.schedule)
        extensions.READ_ONLY_PATHS.add(REGISTRY_PATH)
        lifecycle.on_startup(live.ensure_sweeper, live.stop)
        lifecycle.on_startup(compaction.ensure_sweeper, compaction.stop)
