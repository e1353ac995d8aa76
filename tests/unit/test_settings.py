"""Settings read from the environment (durable_project.settings)."""

from __future__ import annotations

import pytest

from durable_project.settings import database_config


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        # libpq's URL form of a Unix socket's directory: percent-encoded in the host.
        ("postgres://app@%2Frun%2Fpostgresql/streams", "/run/postgresql", ""),
        ("postgres://app@%2ftmp%2fpg:5433/streams", "/tmp/pg", 5433),
        ("postgres://app:secret@db.internal:5432/streams", "db.internal", 5432),
        ("postgres://app@127.0.0.1/streams", "127.0.0.1", ""),
    ],
)
def test_database_urls_name_their_host(url: str, host: str, port: object) -> None:
    config = database_config(url)
    assert (config["HOST"], config["PORT"], config["NAME"]) == (host, port, "streams")
