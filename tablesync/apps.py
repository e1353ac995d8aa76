from __future__ import annotations

from pathlib import Path

from django.apps import AppConfig


class TablesyncConfig(AppConfig):
    name = "tablesync"
    verbose_name = "Table sync"
    default_auto_field = "django.db.models.BigAutoField"
    # Publication triggers and the sink's apply functions; they call the streams app's append
    # (ds_append) and the state app's helpers (ds_rfc3339), so they install after both
    # (streams.store.schema).
    sql_dir = Path(__file__).resolve().parent / "sql"
    sql_requires = ("streams", "state")

    def ready(self) -> None:
        from streams import lifecycle
        from tablesync import runner

        runner.listen_for_changes()
        lifecycle.on_startup(runner.ensure_started, runner.stop)
