"""``spark_materialize`` refuses what it cannot do with one clear line, no traceback, a
non-zero exit, and nothing written: no Java, no JDBC driver, a bad --output, streams that are
not registered, no streams named (spark/management/commands/spark_materialize.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import ServerProcess, command_env, manage
from tests.spark.support import (
    db_entities,
    db_registration,
    staging_tables,
)
from tests.state.support import change, create_json_stream, register_ok


@pytest.fixture(scope="module")
def registered(server: ServerProcess, pg: psycopg.Connection[Any]) -> Iterator[str]:
    """A registered state stream with a few entities, checked unchanged after every test."""
    path = f"tests/spark/errors/registered-{time.time_ns()}"
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        events = [change("item", f"k{i}", {"n": i}) for i in range(20)]
        create_json_stream(http, path, events)
        register_ok(http, path)
    before = (db_entities(pg, path), db_registration(pg, path))
    assert len(before[0]) == 20
    yield path
    assert (db_entities(pg, path), db_registration(pg, path)) == before


@pytest.fixture(scope="module")
def unregistered(server: ServerProcess) -> str:
    """A JSON stream that is not a state stream."""
    path = f"tests/spark/errors/plain-{time.time_ns()}"
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        create_json_stream(http, path)
    return path


def assert_one_line_error(result: Any, *fragments: str) -> str:
    """Exit status 1, nothing on stdout, and on stderr only ``CommandError: <one line>``
    holding every fragment."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("CommandError: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def test_missing_jdbc_jar(registered: str, database_url: str, pg: psycopg.Connection[Any]) -> None:
    result = manage(
        database_url, "spark_materialize", "--stream", registered, "--jdbc-jar", "/nonexistent.jar"
    )
    assert_one_line_error(result, "/nonexistent.jar", "libpostgresql-jdbc-java", "--jdbc-jar")
    assert staging_tables(pg) == []


def test_missing_jdbc_jar_from_the_environment(registered: str, database_url: str) -> None:
    """DS_SPARK__JDBC_JAR names the default jar."""
    env = command_env(database_url, DS_SPARK__JDBC_JAR="/nowhere/postgresql.jar")
    result = manage(database_url, "spark_materialize", "--stream", registered, env=env)
    assert_one_line_error(result, "/nowhere/postgresql.jar", "libpostgresql-jdbc-java")


def test_missing_java(registered: str, database_url: str) -> None:
    """No java on PATH (only the virtualenv's bin) and no JAVA_HOME."""
    env = command_env(database_url, PATH=str(Path(sys.executable).parent), JAVA_HOME=None)
    result = manage(database_url, "spark_materialize", "--stream", registered, env=env)
    assert_one_line_error(result, "Java not found", "install a JRE")


def test_java_home_without_java(registered: str, database_url: str, tmp_path: Path) -> None:
    """A JAVA_HOME that holds no bin/java is no Java either."""
    env = command_env(database_url, JAVA_HOME=str(tmp_path))
    result = manage(database_url, "spark_materialize", "--stream", registered, env=env)
    assert_one_line_error(result, "Java not found", "install a JRE")


@pytest.mark.parametrize("output", ["csv", "parquet", "parquet:", "Postgres", ""])
def test_bad_output(registered: str, database_url: str, output: str) -> None:
    result = manage(database_url, "spark_materialize", "--stream", registered, "--output", output)
    assert_one_line_error(result, "--output must be postgres or parquet:DIR")


def test_unregistered_streams(
    registered: str, unregistered: str, database_url: str, pg: psycopg.Connection[Any]
) -> None:
    """A plain JSON stream and a path with no stream at all are both named; the registered
    stream named with them is left alone (nothing runs)."""
    missing = f"tests/spark/errors/missing-{time.time_ns()}"
    result = manage(
        database_url, "spark_materialize",
        "--stream", registered, "--stream", unregistered, "--stream", missing,
    )  # fmt: skip
    line = assert_one_line_error(result, "not state streams", unregistered, missing)
    assert f"{registered}," not in line and not line.endswith(registered)
    assert staging_tables(pg) == []


@pytest.mark.parametrize("args", [[], ["--all", "--stream", "x"]], ids=["neither", "both"])
def test_streams_or_all(database_url: str, args: list[str]) -> None:
    result = manage(database_url, "spark_materialize", *args)
    assert_one_line_error(result, "--stream PATH", "--all")
