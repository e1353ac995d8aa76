"""The console keeps no data of its own; this model only carries its permissions (Django
attaches permissions to a model), so staff can be given the console's write action or not."""

from __future__ import annotations

from django.db import models


class Console(models.Model):
    class Meta:
        managed = False  # no table
        default_permissions = ()
        permissions = [("append_messages", "Can append messages to streams from the console")]

    def __str__(self) -> str:
        return "console"
