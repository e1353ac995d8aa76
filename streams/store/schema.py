"""Installs the SQL functions of ``streams/store/sql/`` into the database."""

from __future__ import annotations

from pathlib import Path

from django.db import connections

SQL_DIR = Path(__file__).resolve().parent / "sql"


def install_functions(using: str = "default") -> None:
    with connections[using].cursor() as cursor:
        for script in sorted(SQL_DIR.glob("*.sql")):
            cursor.execute(script.read_text())
