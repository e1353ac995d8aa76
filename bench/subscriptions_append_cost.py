"""What subscriptions cost the write path when no subscription follows the stream written.

Usage: python bench/subscriptions_append_cost.py [--calls N] [--subscriptions N] [--repeat N]

Creates a throwaway database in the project's PostgreSQL (``DATABASE_URL``, or the local
cluster, which must run on this machine), migrated; measures the CPU time of the PostgreSQL
backend running ``ds_append`` (one 100-byte message) and ``ds_create`` N times in one
statement (so the figure is the functions' own CPU, without commits and round trips, which
dwarf it), in three settings:

* the subscription triggers on ``ds_stream`` disabled: the write path as it was before them;
* the triggers on, no subscription at all;
* the triggers on, with SUBSCRIPTIONS subscriptions (half glob patterns, half explicit
  streams) none of which follows the streams written.

Prints CPU microseconds per call (median of the repeats, the settings measured in turn) and
the difference. The database is
dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRIGGERS = ("ds_sub_stream_created", "ds_sub_stream_advanced")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Loops inside PostgreSQL: the functions' own time, without a round trip per call.
HELPERS = """
CREATE FUNCTION bench_appends(p_paths text[]) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz := clock_timestamp();
    p text;
BEGIN
    FOREACH p IN ARRAY p_paths LOOP
        PERFORM ds_append(p, '[["text/plain", false, null, null, null, null, 1, 100, null]]',
            ARRAY[100], ARRAY[1], convert_to(repeat('x', 100), 'UTF8'), 1073741824);
    END LOOP;
    RETURN extract(epoch FROM clock_timestamp() - t);
END $$;
CREATE FUNCTION bench_creates(p_paths text[]) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz := clock_timestamp();
    p text;
BEGIN
    FOREACH p IN ARRAY p_paths LOOP
        PERFORM ds_create(p, 'text/plain', NULL, NULL, false, '{}'::bytea[], 1073741824,
            NULL, NULL, NULL, NULL, NULL, NULL, NULL);
    END LOOP;
    RETURN extract(epoch FROM clock_timestamp() - t);
END $$;
"""


def server_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    from durable_project import localdb

    return localdb.ensure_running()


def backend_cpu(pid: int) -> float:
    """CPU seconds (user and system) of a PostgreSQL backend on this machine: shared machines
    make wall time too noisy for differences of microseconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def timed(conn: psycopg.Connection, function: str, paths: list[str]) -> float:
    """CPU microseconds per call of ``function`` over ``paths`` (one statement), in a
    transaction rolled back."""
    pid = conn.info.backend_pid
    with conn.transaction(force_rollback=True):
        before = backend_cpu(pid)
        conn.execute(f"SELECT {function}(%s::text[])", (paths,))
        return (backend_cpu(pid) - before) / len(paths) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=6000)
    parser.add_argument("--subscriptions", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    base = server_url()
    name = f"bench_subcost_{uuid.uuid4().hex[:8]}"
    admin = base.rsplit("/", 1)[0] + "/postgres"
    url = base.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        env = {**os.environ, "DATABASE_URL": url}
        env.setdefault("DJANGO_SECRET_KEY", "bench-subscription-cost-not-a-secret")
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"],
            cwd=ROOT, env=env, check=True,
        )  # fmt: skip
        with psycopg.connect(url, autocommit=True) as conn:
            measure(conn, args)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def measure(conn: psycopg.Connection, args: argparse.Namespace) -> None:
    conn.execute(HELPERS)
    streams = [f"cost/s{i}" for i in range(100)]
    conn.execute("SELECT bench_creates(%s::text[])", (streams,))
    appends = [streams[i % len(streams)] for i in range(args.calls)]

    def triggers(on: bool) -> None:
        for trigger in TRIGGERS:
            conn.execute(f"ALTER TABLE ds_stream {'ENABLE' if on else 'DISABLE'} TRIGGER {trigger}")

    def phase(label: str) -> None:
        """Triggers off and on in turn (the machine's noise hits both alike)."""
        figures: dict[tuple[bool, str], list[float]] = {}
        for _ in range(args.repeat):
            for on in (False, True):
                triggers(on)
                creates = [f"cost/new/{uuid.uuid4().hex}" for _ in range(args.calls // 3)]
                figures.setdefault((on, "append"), []).append(timed(conn, "bench_appends", appends))
                figures.setdefault((on, "create"), []).append(timed(conn, "bench_creates", creates))
        median = {key: statistics.median(values) for key, values in figures.items()}
        for kind in ("append", "create"):
            off, on = median[(False, kind)], median[(True, kind)]
            print(
                f"{label:<34} {kind:<6}  triggers off {off:6.1f} us   on {on:6.1f} us"
                f"   {on - off:+5.1f} us ({(on - off) / off:+.0%})"
            )

    phase("no subscription")
    for i in range(args.subscriptions):
        if i % 2:
            pattern, regex, prefix, explicit = (
                f"elsewhere/{i}/**", f"^/elsewhere/{i}(?:/[^/]+)*$", f"elsewhere/{i}/", []
            )  # fmt: skip
        else:
            pattern, regex, prefix, explicit = None, None, None, [f"elsewhere/explicit/{i}"]
        conn.execute(
            "SELECT ds_sub_create(%s, 'webhook', %s, %s, %s, %s::text[], %s, NULL, 30000, NULL,"
            " 'h', 'http://x', NULL)",
            (f"other-{i}", pattern, regex, prefix, explicit, "https://hooks.example/x"),
        )
    # As autovacuum would after so many rows: plans made while the table was empty (a
    # sequential scan) are replaced by ones that use its indexes.
    conn.execute("ANALYZE ds_subscription")
    conn.execute("ANALYZE ds_subscription_link")
    phase(f"{args.subscriptions} subscriptions elsewhere")
    triggers(True)


if __name__ == "__main__":
    main()
