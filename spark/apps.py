from __future__ import annotations

from django.apps import AppConfig


class SparkConfig(AppConfig):
    name = "spark"
    verbose_name = "Spark jobs"
