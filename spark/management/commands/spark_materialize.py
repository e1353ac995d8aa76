"""``manage.py spark_materialize [--stream PATH ...] [--all] [--master URL] [--partitions N]
[--jdbc-jar PATH] [--output postgres|parquet:DIR] [--dry-run]``

Materializes State Protocol streams with Spark: reads messages over JDBC in parallel, computes
each stream's final state (spark/jobs/materialize_state.py), and publishes it atomically into
the state tables (spark/publish.py), or writes Parquet. See docs/spark.md for clusters.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from spark.publish import create_staging_table, drop_staging_table, plan, publish

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_JAR = "/usr/share/java/postgresql.jar"


class Command(BaseCommand):
    help = "Materialize State Protocol streams with Spark (local[*] or any cluster master)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--stream", action="append", dest="streams", metavar="PATH",
                            help="a registered state stream (repeatable)")  # fmt: skip
        parser.add_argument("--all", action="store_true", help="every registered state stream")
        parser.add_argument("--master", default="local[*]",
                            help="local[*], spark://host:7077, yarn, k8s://...")  # fmt: skip
        parser.add_argument("--partitions", type=int, default=8,
                            help="parallel JDBC reads (ranges of seq) and write tasks")  # fmt: skip
        parser.add_argument("--jdbc-jar", default=os.environ.get("DS_SPARK__JDBC_JAR", DEFAULT_JAR),
                            help=f"PostgreSQL JDBC driver jar (default {DEFAULT_JAR})")  # fmt: skip
        parser.add_argument("--output", default="postgres",
                            help="postgres (the state tables) or parquet:DIR")  # fmt: skip
        parser.add_argument("--dry-run", action="store_true",
                            help="compute and report, write nothing")  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        output = options["output"]
        if output != "postgres" and not (output.startswith("parquet:") and len(output) > 8):
            raise CommandError("--output must be postgres or parquet:DIR")
        if bool(options["streams"]) == bool(options["all"]):
            raise CommandError("name streams with --stream PATH, or pass --all (not both)")
        _check_environment(options["jdbc_jar"])
        try:
            planned = plan(options["streams"])
        except LookupError as exc:
            raise CommandError(str(exc)) from None
        if not planned:
            self.stdout.write("No state streams to materialize.")
            return
        events = sum(p.tail_seq for p in planned)
        self.stdout.write(
            f"plan: {len(planned)} streams, {events} messages, master {options['master']}"
        )

        started = time.monotonic()
        spark = _session(options["master"], options["jdbc_jar"], options["partitions"])
        self.stdout.write(f"spark: session ready in {time.monotonic() - started:.1f}s")
        staging = (
            create_staging_table() if output == "postgres" and not options["dry_run"] else None
        )
        try:
            from spark.jobs.materialize_state import StreamPlan, run

            plans = [StreamPlan(p.stream_id, p.path, p.segments, p.schemas) for p in planned]
            reports = run(
                spark,
                jdbc_url=_jdbc_url(),
                properties=_jdbc_properties(),
                plans=plans,
                partitions=options["partitions"],
                output=output,
                staging_table=staging,
                dry_run=options["dry_run"],
                progress=self.stdout.write,
            )
            by_id = {r.stream_id: r for r in reports}
            for p in planned:
                r = by_id.get(p.stream_id)
                if r is not None:
                    self.stdout.write(
                        f"  {p.path}: {r.events} events, {r.invalid} invalid, {r.entities} entities"
                    )
                    if r.last_error:
                        self.stdout.write(f"    last invalid: {r.last_error}")
            if staging is not None:
                invalid = {r.stream_id: (r.invalid, r.last_error) for r in reports}
                published = publish(staging, planned, invalid)
                self.stdout.write(
                    f"publish: {published.streams} streams swapped in one transaction"
                    f" (+{published.caught_up} messages appended meanwhile applied)"
                )
        finally:
            if staging is not None:
                drop_staging_table(staging)
            spark.stop()
        self.stdout.write(self.style.SUCCESS(f"Done in {time.monotonic() - started:.1f}s."))


def _check_environment(jar: str) -> None:
    """One-line errors for what Spark needs on this machine, instead of tracebacks."""
    java_home = os.environ.get("JAVA_HOME")
    java = Path(java_home, "bin", "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise CommandError(
            "Java not found: install a JRE (Debian: apt-get install default-jre-headless) "
            "or set JAVA_HOME"
        )
    if not Path(jar).is_file():
        raise CommandError(
            f"PostgreSQL JDBC driver not found at {jar}: apt-get install "
            "libpostgresql-jdbc-java, or pass --jdbc-jar PATH"
        )
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise CommandError("pyspark is not installed: pip install -r requirements.txt") from None


def _session(master: str, jar: str, partitions: int) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    if master.startswith("local"):
        # Local executors run this interpreter (the project's virtualenv, with pycrdt and
        # jsonschema-rs); on a cluster PYSPARK_PYTHON names the executors' own (docs/spark.md).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.pyspark.python", sys.executable)
    spark = (
        builder.master(master)
        .appName("durable-streams-materialize")
        .config("spark.jars", jar)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(max(partitions, 2)))
        .config("spark.sql.adaptive.enabled", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.sparkContext.addPyFile(_code_archive())
    return spark


def _code_archive() -> str:
    """state/core, spark/jobs and the offset format as a zip for the executors (their only
    imports)."""
    archive = Path(tempfile.mkdtemp(prefix="ds-spark-")) / "durable_streams_job.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for package in ("state/core", "spark/jobs"):
            for path in (ROOT / package).glob("*.py"):
                zf.write(path, f"{package}/{path.name}")
        for module in ("streams/errors.py", "streams/protocol/offsets.py"):
            zf.write(ROOT / module, module)
        for package in ("state", "spark", "streams", "streams/protocol"):
            zf.writestr(f"{package}/__init__.py", "")
    return str(archive)


def _jdbc_url() -> str:
    db = settings.DATABASES["default"]
    host = db.get("HOST") or "localhost"
    port = db.get("PORT") or 5432
    return f"jdbc:postgresql://{host}:{port}/{db['NAME']}"


def _jdbc_properties() -> dict[str, str]:
    db = settings.DATABASES["default"]
    return {
        "user": db.get("USER") or "postgres",
        "password": db.get("PASSWORD") or "",
        "driver": "org.postgresql.Driver",
    }
