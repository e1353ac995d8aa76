"""Materialize State Protocol streams with Spark (STATE-PROTOCOL.md 6; state-protocol-0.1.md 5).

Plain PySpark, no Django: ``manage.py spark_materialize`` runs it in-process, and it can be
sent to a cluster with ``spark-submit`` (docs/spark.md). It needs ``state/core`` importable on
the executors (``--py-files``), the same event rules the server uses.

Input: a plan (JSON) naming each stream's id, path, the segments of rows that make it up
(``[stream id, first seq, end seq)``: the stream, or a fork's chain), and the JSON Schemas
registered for it. Messages are read over JDBC in parallel, by ranges of ``seq``.

Semantics, identical to the in-process materializer (state/materializer.py):
* events are applied in stream order; per (stream, type, key) the last change wins;
* a delete removes the entity; only events after a stream's last ``reset`` count;
* an event that is not a valid State Event, whose value fails its type's schema, or that
  PostgreSQL's jsonb cannot hold, is counted as invalid and never materialized.

Output: one row per live entity (stream_id, stream, type, key, value JSON text, offset of the
event that set it), written to a PostgreSQL staging table or as Parquet partitioned by stream
and type; and per stream: events read, invalid events, the last invalid event's description.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

EVENT_SCHEMA = T.StructType(
    [
        T.StructField("stream_id", T.LongType()),
        T.StructField("seq", T.LongType()),
        T.StructField("event_offset", T.StringType()),
        # change | reset | control | invalid
        T.StructField("kind", T.StringType()),
        T.StructField("type", T.StringType()),
        T.StructField("key", T.StringType()),
        T.StructField("deleted", T.BooleanType()),
        T.StructField("value", T.StringType()),
        T.StructField("error", T.StringType()),
    ]
)


@dataclass(frozen=True)
class StreamPlan:
    stream_id: int
    path: str
    segments: list[tuple[int, int, int]]
    schemas: dict[str, Any]


@dataclass(frozen=True)
class StreamReport:
    stream_id: int
    events: int
    invalid: int
    last_error: str
    entities: int


def load_plan(text: str) -> list[StreamPlan]:
    return [
        StreamPlan(p["stream_id"], p["path"], [tuple(s) for s in p["segments"]], p["schemas"])
        for p in json.loads(text)
    ]


def _messages_query(plans: list[StreamPlan]) -> str:
    """One SQL query for every segment of every stream; ``seq`` partitions the JDBC read."""
    ranges = " OR ".join(
        f"(stream_id = {int(sid)} AND seq >= {int(lo)} AND seq < {int(hi)})"
        for plan in plans
        for sid, lo, hi in plan.segments
    )
    owners = " ".join(
        f"WHEN stream_id = {int(sid)} AND seq >= {int(lo)} AND seq < {int(hi)} "
        f"THEN {int(plan.stream_id)}"
        for plan in plans
        for sid, lo, hi in plan.segments
    )
    return (
        f"(SELECT CASE {owners} END AS owner, seq, pos, data FROM ds_message "
        f"WHERE {ranges}) AS messages"
    )


def read_messages(
    spark: SparkSession,
    jdbc_url: str,
    properties: dict[str, str],
    plans: list[StreamPlan],
    partitions: int,
) -> DataFrame:
    upper = max((hi for plan in plans for _, _, hi in plan.segments), default=1)
    return spark.read.jdbc(
        url=jdbc_url,
        table=_messages_query(plans),
        column="seq",
        lowerBound=0,
        upperBound=max(upper, 1),
        numPartitions=max(1, partitions),
        properties={**properties, "fetchsize": "5000"},
    )


def parse_partition(rows: Iterable[Any], schemas: dict[int, dict[str, Any]]) -> Iterator[tuple]:
    """Decode and judge each message with the server's own rules (state.core): the same
    parser, schema validation and storability check as the in-process materializer."""
    from state.core import ChangeEvent, ControlEvent
    from state.core.schemas import compile_schemas, judge
    from streams.protocol.offsets import Offset

    validators = {stream_id: compile_schemas(by_type) for stream_id, by_type in schemas.items()}
    for row in rows:
        stream_id, seq, pos, data = row["owner"], row["seq"], row["pos"], bytes(row["data"])
        offset = str(Offset(seq, pos))
        event, reason = judge(data, validators[stream_id])
        if event is None:
            yield (stream_id, seq, offset, "invalid", None, None, None, None, reason)
            continue
        if isinstance(event, ControlEvent):
            kind = "reset" if event.control == "reset" else "control"
            yield (stream_id, seq, offset, kind, None, None, None, None, None)
            continue
        assert isinstance(event, ChangeEvent)
        deleted = event.operation == "delete"
        value = None if deleted else json.dumps(event.value, separators=(",", ":"))
        yield (stream_id, seq, offset, "change", event.type, event.key, deleted, value, None)


def materialize(events: DataFrame) -> tuple[DataFrame, DataFrame]:
    """(entities, per-stream counts) from parsed events."""
    resets = (
        events.filter(F.col("kind") == "reset")
        .groupBy("stream_id")
        .agg(F.max("seq").alias("reset_seq"))
    )
    latest = Window.partitionBy("stream_id", "type", "key").orderBy(F.col("seq").desc())
    entities = (
        events.filter(F.col("kind") == "change")
        .join(F.broadcast(resets), "stream_id", "left")
        .filter(F.col("reset_seq").isNull() | (F.col("seq") > F.col("reset_seq")))
        .withColumn("rank", F.row_number().over(latest))
        .filter((F.col("rank") == 1) & ~F.col("deleted"))
        .select("stream_id", "type", "key", "value", "event_offset")
    )
    is_invalid = F.col("kind") == "invalid"
    description = F.concat(
        F.lit("event at offset "), F.col("event_offset"), F.lit(": "), F.col("error")
    )
    counts = events.groupBy("stream_id").agg(
        F.count(F.lit(1)).alias("events"),
        F.sum(F.when(is_invalid, 1).otherwise(0)).alias("invalid"),
        # The last invalid event (max_by ignores rows whose ordering value is null).
        F.max_by(F.when(is_invalid, description), F.when(is_invalid, F.col("seq"))).alias(
            "last_error"
        ),
    )
    return entities, counts


def run(
    spark: SparkSession,
    *,
    jdbc_url: str,
    properties: dict[str, str],
    plans: list[StreamPlan],
    partitions: int,
    output: str,
    staging_table: str | None,
    dry_run: bool,
    progress: Any = print,
) -> list[StreamReport]:
    """Read, compute, write; returns what happened per stream."""
    schemas = {plan.stream_id: plan.schemas for plan in plans}
    messages = read_messages(spark, jdbc_url, properties, plans, partitions)
    progress(f"read: {len(plans)} streams over JDBC in {partitions} partitions")
    events = spark.createDataFrame(
        messages.rdd.mapPartitions(lambda rows: parse_partition(rows, schemas)), EVENT_SCHEMA
    ).cache()
    entities, counts = materialize(events)
    entities = entities.cache()
    per_stream = entities.groupBy("stream_id").agg(F.count(F.lit(1)).alias("n")).collect()
    entity_counts = {row["stream_id"]: row["n"] for row in per_stream}
    reports = [
        StreamReport(
            r["stream_id"],
            r["events"],
            r["invalid"],
            r["last_error"] or "",
            entity_counts.get(r["stream_id"], 0),
        )
        for r in counts.collect()
    ]
    total = sum(r.events for r in reports)
    progress(
        f"compute: {total} events, {sum(r.invalid for r in reports)} invalid, "
        f"{sum(r.entities for r in reports)} entities"
    )
    if not dry_run:
        if output == "postgres":
            assert staging_table is not None
            (
                entities.repartition(max(1, partitions)).write.mode("append")
                .jdbc(jdbc_url, staging_table, properties=properties)
            )  # fmt: skip
            progress(f"write: entities staged in {staging_table}")
        else:
            directory = output.removeprefix("parquet:")
            paths = spark.createDataFrame(
                [(plan.stream_id, plan.path) for plan in plans], "stream_id long, stream string"
            )
            (
                entities.join(paths, "stream_id")
                .select("stream", "type", "key", "value", F.col("event_offset").alias("offset"))
                .write.mode("overwrite").partitionBy("stream", "type").parquet(directory)
            )  # fmt: skip
            progress(f"write: Parquet in {directory}, partitioned by stream and type")
    events.unpersist()
    entities.unpersist()
    return reports


def main(argv: list[str]) -> int:
    """spark-submit entry point (docs/spark.md)."""
    parser = argparse.ArgumentParser(description="Materialize State Protocol streams")
    parser.add_argument("--jdbc-url", required=True)
    parser.add_argument("--user", default="")
    parser.add_argument("--password", default="")
    parser.add_argument("--plan", required=True, help="path of the plan JSON")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--output", default="postgres")
    parser.add_argument("--staging-table")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    with open(args.plan) as plan_file:  # noqa: PTH123 - runs on a driver without pathlib habits
        plans = load_plan(plan_file.read())
    spark = SparkSession.builder.appName("durable-streams-materialize").getOrCreate()
    properties = {"user": args.user, "password": args.password, "driver": "org.postgresql.Driver"}
    reports = run(
        spark,
        jdbc_url=args.jdbc_url,
        properties=properties,
        plans=plans,
        partitions=args.partitions,
        output=args.output,
        staging_table=args.staging_table,
        dry_run=args.dry_run,
    )
    print(json.dumps([report.__dict__ for report in reports]))  # noqa: T201 - the job's output
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
