"""PostgreSQL out of something (disk, memory, temporary space, connections: SQLSTATE class 53):
the requests it fails get 503 with Retry-After, never a 500 and a traceback (probe 10j: a full
disk made every write a 500 and logged a traceback for each, a flood at the moment the disk
was full).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psycopg

from tests.conftest import ServerProcess

JSON = {"Content-Type": "application/json"}


def _set(database_url: str, **settings: str) -> None:
    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url, autocommit=True) as conn:
        for key, value in settings.items():
            conn.execute(f"ALTER DATABASE \"{name}\" SET {key} = '{value}'")


def test_a_limit_of_the_database_is_a_503(own_database: str, tmp_path: Path) -> None:
    """A catch-up read whose sort spills past ``temp_file_limit`` (SQLSTATE 53400) was a 500,
    as a full disk (53100) was for every write."""
    _set(own_database, temp_file_limit="64kB", work_mem="64kB")
    server = ServerProcess(own_database, {}, tmp_path / "limits.log", "uvicorn")
    try:
        url = server.stream_url(f"limits/{time.time_ns()}")
        with httpx.Client(timeout=30) as http:
            assert http.put(url, headers=JSON).status_code == 201
            batch = b"[" + b",".join(b'{"n":%d,"pad":"%s"}' % (n, b"x" * 200) for n in range(300))
            for _ in range(20):
                assert http.post(url, headers=JSON, content=batch + b"]").status_code == 204
            read = http.get(url, params={"offset": "-1"})
        assert read.status_code == 503, (read.status_code, read.text[:200])
        assert int(read.headers["Retry-After"]) > 0
        assert "out of resources" in read.text
    finally:
        server.stop()
    assert "Traceback" not in (tmp_path / "limits.log").read_text()
