"""``manage.py spark_materialize`` computes exactly the state the in-process materializer does.

One history of 101,000 messages (seven entity types, thousands of keys, inserts, updates,
deletes, two resets, no-op control events, malformed events and values that fail the
registered JSON Schema) is appended over HTTP before its stream is registered; the
registration's backfill (state/materializer.py) is the reference. The stored state is then
damaged, so that a Spark run which wrote nothing could not pass, and the same history is
materialized by Spark: with --dry-run (nothing changes), as Parquet (read back with pyspark),
and into PostgreSQL (the damage is repaired, entity for entity).

Semantics checked: state-protocol-0.1.md 5 (last change per key wins, delete removes, reset
clears what came before) and STATE-PROTOCOL.md 6 (materialization); the command's contract is
spark/management/commands/spark_materialize.py and spark/publish.py.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import psycopg
import pytest

from tests.conftest import ROOT, command_env
from tests.spark.support import (
    COMMAND_TIMEOUT,
    TYPES,
    Entity,
    RegistrationRow,
    api_entities,
    canonical_text,
    damage,
    db_entities,
    db_registration,
    history,
    malformed,
    normalized,
    output_number,
    schema_violation,
    spark_materialize,
    staging_tables,
)
from tests.state.support import (
    USER_SCHEMA,
    append_batches,
    create_json_stream,
    entities,
    register_ok,
    tail,
)

pytestmark = pytest.mark.slow

MESSAGES = 101_000
RESETS_AT = (31_337, 64_000)
SCHEMAS = {"user": USER_SCHEMA}


@dataclass(frozen=True)
class Reference:
    path: str
    tail: str
    messages: int
    entities: set[Entity]  # as the registration's in-process backfill left them
    registration: RegistrationRow
    damaged_entities: set[Entity]  # what the state holds before the Spark runs
    damaged_registration: RegistrationRow


@dataclass(frozen=True)
class Run:
    stdout: str
    entities: set[Entity]
    registration: RegistrationRow
    staging_tables: list[str]


def _history() -> list[Any]:
    rng = random.Random(20240607)
    messages = history(rng, MESSAGES - 2, resets_at=RESETS_AT, invalid_rate=0.012)
    # The stream ends with a malformed event and a schema violation, after everything valid,
    # so that the last invalid event is a known one.
    messages = [*messages, malformed(rng), schema_violation(rng)]
    operations = Counter(
        m["headers"].get("operation") or m["headers"].get("control")
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("headers"), dict)
    )
    assert min(operations["insert"], operations["update"], operations["delete"]) > 10_000
    assert operations["reset"] > len(RESETS_AT)  # the valid ones and some malformed
    return messages


@pytest.fixture(scope="module")
def reference(http: httpx.Client, pg: psycopg.Connection[Any]) -> Reference:
    path = f"tests/spark/equals/{time.time_ns()}"
    messages = _history()
    assert len(messages) == MESSAGES
    create_json_stream(http, path)
    append_batches(http, path, messages)
    stream_tail = tail(http, path)
    assert int(stream_tail.split("_")[0]) == MESSAGES

    registered = register_ok(http, path, SCHEMAS)
    assert registered["materialized_offset"] == stream_tail
    backfilled = db_entities(pg, path)
    registration = db_registration(pg, path)
    # The history is what this test needs: thousands of entities of every type, hundreds of
    # invalid events.
    assert len(backfilled) > 3000
    assert {t for t, _, _, _ in backfilled} == set(TYPES)
    assert 500 < registration.invalid_events < 5000
    assert registration.last_error.startswith("event at offset ")
    assert api_entities(entities(http, path)) == normalized(backfilled)

    damaged = damage(pg, path)
    return Reference(
        path=path,
        tail=stream_tail,
        messages=MESSAGES,
        entities=backfilled,
        registration=registration,
        damaged_entities=damaged,
        damaged_registration=db_registration(pg, path),
    )


def _run(database_url: str, pg: psycopg.Connection[Any], path: str, *args: str) -> Run:
    result = spark_materialize(database_url, "--stream", path, *args)
    return Run(
        stdout=result.stdout,
        entities=db_entities(pg, path),
        registration=db_registration(pg, path),
        staging_tables=staging_tables(pg),
    )


# The runs are module fixtures chained in the order they must happen: dry run and Parquet
# first, while the stored state is still the damaged one; PostgreSQL last.


@pytest.fixture(scope="module")
def dry_run(reference: Reference, database_url: str, pg: psycopg.Connection[Any]) -> Run:
    return _run(database_url, pg, reference.path, "--dry-run")


@dataclass(frozen=True)
class ParquetRun:
    run: Run
    directory: Path
    rows: list[list[Any]]  # [stream, type, key, value, offset] as pyspark reads them back


@pytest.fixture(scope="module")
def parquet_run(
    reference: Reference,
    dry_run: Run,
    database_url: str,
    pg: psycopg.Connection[Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> ParquetRun:
    directory = tmp_path_factory.mktemp("spark-parquet") / "state"
    run = _run(database_url, pg, reference.path, "--output", f"parquet:{directory}")
    return ParquetRun(run, directory, _read_parquet(directory, database_url))


READ_PARQUET = """
import json, sys
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
frame = spark.read.parquet(sys.argv[1])
print("COLUMNS " + json.dumps(sorted(frame.columns)))
for row in frame.toLocalIterator():
    print("ROW " + json.dumps([row["stream"], row["type"], row["key"], row["value"],
                               row["offset"]]))
spark.stop()
"""


def _read_parquet(directory: Path, database_url: str) -> list[list[Any]]:
    result = subprocess.run(
        [sys.executable, "-c", READ_PARQUET, str(directory)],
        cwd=ROOT,
        env=command_env(database_url),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    columns = [json.loads(line[8:]) for line in lines if line.startswith("COLUMNS ")]
    assert columns == [["key", "offset", "stream", "type", "value"]]
    return [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]


@pytest.fixture(scope="module")
def postgres_run(
    reference: Reference, parquet_run: ParquetRun, database_url: str, pg: psycopg.Connection[Any]
) -> Run:
    return _run(database_url, pg, reference.path)


def _assert_computed(stdout: str, reference: Reference) -> None:
    """The plan, read and compute stages report the stream's own numbers."""
    assert output_number(stdout, r"^plan: (\d+) streams, (\d+) messages, master local") == (
        1,
        reference.messages,
    )
    assert output_number(stdout, r"^read: (\d+) streams over JDBC in (\d+) partitions$") == (1, 4)
    assert output_number(stdout, r"^compute: (\d+) events, (\d+) invalid, (\d+) entities$") == (
        reference.messages,
        reference.registration.invalid_events,
        len(reference.entities),
    )
    per_stream = rf"^  {reference.path}: (\d+) events, (\d+) invalid, (\d+) entities$"
    assert output_number(stdout, per_stream) == (
        reference.messages,
        reference.registration.invalid_events,
        len(reference.entities),
    )
    # The same last invalid event (its description is compared separately, below).
    last_offset = reference.registration.last_error.split(":")[0]
    assert f"    last invalid: {last_offset}: " in stdout
    assert "Done in " in stdout


# -- the tests -------------------------------------------------------------------------------


def test_dry_run_computes_and_writes_nothing(reference: Reference, dry_run: Run) -> None:
    """--dry-run: "compute and report, write nothing" (spark_materialize's --dry-run help)."""
    _assert_computed(dry_run.stdout, reference)
    assert "write:" not in dry_run.stdout
    assert "publish:" not in dry_run.stdout
    assert dry_run.entities == reference.damaged_entities
    assert dry_run.registration == reference.damaged_registration
    assert dry_run.staging_tables == []


def test_parquet_output_holds_the_same_entities(
    reference: Reference, parquet_run: ParquetRun
) -> None:
    """--output parquet:DIR writes every entity (stream, type, key, value JSON, offset),
    partitioned by stream and type, and leaves the state tables alone."""
    run = parquet_run.run
    _assert_computed(run.stdout, reference)
    assert f"write: Parquet in {parquet_run.directory}, partitioned by stream and type" in (
        run.stdout
    )
    assert "publish:" not in run.stdout
    assert run.entities == reference.damaged_entities
    assert run.registration == reference.damaged_registration
    assert run.staging_tables == []

    assert {row[0] for row in parquet_run.rows} == {reference.path}
    read_back = {(t, k, canonical_text(v), o) for _, t, k, v, o in parquet_run.rows}
    assert len(read_back) == len(parquet_run.rows)
    assert read_back == normalized(reference.entities)

    # Hive-style partition directories: stream=<escaped path>/type=<type>/part-*.parquet.
    stream_dirs = [p for p in parquet_run.directory.iterdir() if p.is_dir()]
    assert [unquote(p.name) for p in stream_dirs] == [f"stream={reference.path}"]
    type_dirs = sorted(p.name for p in stream_dirs[0].iterdir())
    assert type_dirs == sorted(f"type={t}" for t in TYPES)
    for type_dir in stream_dirs[0].iterdir():
        assert list(type_dir.glob("part-*.parquet")), type_dir


def test_spark_equals_in_process(
    reference: Reference, postgres_run: Run, http: httpx.Client
) -> None:
    """Into PostgreSQL: the entities equal the in-process backfill's, entity for entity (type,
    key, value, offset of the event that set it); the registration reports the same invalid
    count and is materialized to the stream's tail."""
    run = postgres_run
    _assert_computed(run.stdout, reference)
    assert re.search(r"^write: entities staged in ds_entity_stage_\w+$", run.stdout, re.M)
    assert output_number(
        run.stdout,
        r"^publish: (\d+) streams swapped in one transaction \(\+(\d+) messages appended",
    ) == (1, 0)

    missing = reference.entities - run.entities
    unexpected = run.entities - reference.entities
    assert not missing and not unexpected, (
        f"{len(missing)} missing, e.g. {sorted(missing)[:3]}; "
        f"{len(unexpected)} unexpected, e.g. {sorted(unexpected)[:3]}"
    )
    assert run.registration.invalid_events == reference.registration.invalid_events
    assert run.registration.materialized_offset == reference.tail == tail(http, reference.path)
    assert run.registration.version == reference.registration.version
    assert run.staging_tables == []
    # And the state API serves it.
    assert api_entities(entities(http, reference.path)) == normalized(reference.entities)
    state = http.get(f"/v1/state/streams/{reference.path}").json()
    assert state["materialized_offset"] == reference.tail
    assert state["invalid_events"] == reference.registration.invalid_events


def test_last_invalid_event_matches_in_process(reference: Reference, postgres_run: Run) -> None:
    """The registration's last_error after a Spark run describes the last invalid event as the
    in-process materializer does (the stream ends with a value that fails USER_SCHEMA)."""
    assert postgres_run.registration.last_error == reference.registration.last_error
