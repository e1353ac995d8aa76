from __future__ import annotations

from django.apps import AppConfig


class YjsConfig(AppConfig):
    name = "yjs"
    verbose_name = "Yjs documents"
    default_auto_field = "django.db.models.BigAutoField"
