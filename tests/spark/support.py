"""Helpers shared by the Spark tests: running ``manage.py spark_materialize`` (and other
commands) as a subprocess against the test database, reading a state stream's entities and
registration straight from PostgreSQL, and generating large State Protocol histories."""

from __future__ import annotations

import json
import random
import re
import subprocess
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg

from streams.protocol.offsets import Offset
from tests.conftest import manage
from tests.state.support import change, control, stream_id

# One Spark run (JVM start-up included) on a loaded 2-core machine stays well below this.
COMMAND_TIMEOUT = 600

Entity = tuple[str, str, str, str]  # (type, key, JSON text of the value, offset)


def spark_materialize(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``spark_materialize ARGS`` and insist that it succeeded."""
    result = manage(database_url, "spark_materialize", "--partitions", "4", *args)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def canonical_text(text: str) -> str:
    """One text per JSON value, whatever its key order or the spelling of its numbers: jsonb
    keeps a number's decimal value and prints 1.5e+300 as 1500...0 and 1e-07 as 0.0000001.
    Numbers become {"\\u0000number": normalized decimal}: no materialized key holds NUL."""

    def number(value: Any) -> dict[str, str]:
        assert isinstance(value, Decimal)
        return {"\u0000number": str(value.normalize())}

    decoded = json.loads(text, parse_float=Decimal, parse_int=Decimal)
    return json.dumps(decoded, sort_keys=True, separators=(",", ":"), default=number)


def canonical(value: Any) -> str:
    """``canonical_text`` of a decoded JSON value."""
    return canonical_text(json.dumps(value))


def db_entities(pg: psycopg.Connection[Any], path: str) -> set[Entity]:
    """Every materialized entity of a stream, as stored in ds_entity (the value as jsonb
    prints it: two equal jsonb values print the same)."""
    rows = pg.execute(
        "SELECT type, key, value::text, event_offset FROM ds_entity WHERE stream_id = %s",
        [stream_id(pg, path)],
    ).fetchall()
    entities = {(t, k, v, o) for t, k, v, o in rows}
    assert len(entities) == len(rows)  # (type, key) is unique, so rows are too
    return entities


@dataclass(frozen=True)
class RegistrationRow:
    version: int
    materialized_offset: str
    invalid_events: int
    last_error: str


def db_registration(pg: psycopg.Connection[Any], path: str) -> RegistrationRow:
    row = pg.execute(
        "SELECT version, materialized_seq, materialized_pos, invalid_events, last_error"
        " FROM ds_state_stream WHERE stream_id = %s",
        [stream_id(pg, path)],
    ).fetchone()
    assert row is not None, f"{path} is not registered"
    version, seq, pos, invalid, last_error = row
    return RegistrationRow(version, str(Offset(seq, pos)), invalid, last_error)


def staging_tables(pg: psycopg.Connection[Any]) -> list[str]:
    """Staging tables of spark/publish.py left in the database."""
    rows = pg.execute(
        "SELECT tablename FROM pg_tables WHERE tablename LIKE 'ds\\_entity\\_stage\\_%%'"
    ).fetchall()
    return [row[0] for row in rows]


def damage(pg: psycopg.Connection[Any], path: str) -> set[Entity]:
    """Make the stored state wrong in every way a Spark run must repair: missing entities,
    wrong values and offsets, entities that should not exist, wrong invalid count. Returns
    the damaged entities."""
    sid = stream_id(pg, path)
    with pg.transaction():
        pg.execute(
            "DELETE FROM ds_entity WHERE id IN (SELECT id FROM ds_entity WHERE stream_id = %s"
            " ORDER BY type, key LIMIT 150)",
            [sid],
        )
        pg.execute(
            "UPDATE ds_entity SET value = '{\"damaged\": true}', event_offset = %s WHERE id IN"
            " (SELECT id FROM ds_entity WHERE stream_id = %s ORDER BY type DESC, key LIMIT 150)",
            ["0000000000000000_0000000000000000", sid],
        )
        pg.execute(
            "UPDATE ds_entity SET event_offset = '0000000000000001_0000000000000001' WHERE id IN"
            " (SELECT id FROM ds_entity WHERE stream_id = %s ORDER BY key DESC LIMIT 50)",
            [sid],
        )
        for i in range(10):
            pg.execute(
                "INSERT INTO ds_entity (stream_id, type, key, value, event_offset)"
                " VALUES (%s, %s, %s, '1', '0000000000000000_0000000000000000')",
                [sid, TYPES[i % len(TYPES)], f"ghost-{i}"],
            )
        pg.execute(
            "UPDATE ds_state_stream SET invalid_events = 0, last_error = 'damaged'"
            " WHERE stream_id = %s",
            [sid],
        )
    return db_entities(pg, path)


def normalized(entities: set[Entity]) -> set[Entity]:
    """Entities with ``canonical_text`` values, to compare with the API's or Parquet's."""
    return {(t, k, canonical_text(v), o) for t, k, v, o in entities}


def api_entities(items: list[dict[str, Any]]) -> set[Entity]:
    """The state API's results ({type, key, value, offset}), comparable to ``normalized``."""
    return {(e["type"], e["key"], canonical(e["value"]), e["offset"]) for e in items}


def output_number(output: str, pattern: str) -> tuple[int, ...]:
    """The integers a line of a command's output matching ``pattern`` reports."""
    match = re.search(pattern, output, re.MULTILINE)
    assert match is not None, f"no line matching {pattern!r} in:\n{output}"
    return tuple(int(group) for group in match.groups())


# -- State Protocol histories -------------------------------------------------------------

TYPES = ["user", "order", "product", "session", "comment", "tag", "invoice"]
# Keys worth having besides the plain ones: non-ASCII, spaces, separators, look-alikes.
# "\\ud800" and "\\u0000" are a backslash and five letters: storable, unlike the characters.
ODD_KEYS = ["ключ", "clé 1", "a/b?c=d&e", "😀", "KEY", "key", "0", " ", "null"]
ODD_KEYS += ["\\ud800", "\\u0000"]


def random_value(rng: random.Random, type_name: str, depth: int = 0) -> Any:
    """A value of ``type_name`` (a user matches USER_SCHEMA); others are any JSON."""
    if type_name == "user":
        user: dict[str, Any] = {"name": f"user {rng.randrange(10**6)} é"}
        if rng.random() < 0.7:
            user["age"] = rng.randrange(100)
        return user
    choice = rng.randrange(9 if depth < 2 else 6)
    if choice == 0:
        return None
    if choice == 1:
        return rng.random() < 0.5
    if choice == 2:
        return rng.choice([0, -1, 2**63, 10**30, rng.randrange(-(10**9), 10**9)])
    if choice == 3:
        return rng.choice([0.5, -2.25, 1e-7, 3.141592653589793, 1.5e300])
    if choice in (4, 5):
        return rng.choice(
            ["", "plain", "ünïcödé ✓", 'quote " and \\ backslash', "tab\tnl\n", "\\u0000"]
        )
    if choice == 6:
        return [random_value(rng, type_name, depth + 1) for _ in range(rng.randrange(4))]
    return {
        f"f{i}": random_value(rng, type_name, depth + 1) for i in range(rng.randrange(1, 5))
    } | {"id": rng.randrange(10**6)}


def malformed(rng: random.Random) -> Any:
    """A message that is not a valid State Event (or whose value cannot be stored)."""
    return rng.choice(
        [
            42,
            "a string",
            None,
            [1, {"headers": {"operation": "insert"}}],  # one message: an array
            {"type": "order", "key": "o-1", "value": 1},  # no headers
            {"type": "order", "key": "o-1", "value": 1, "headers": "insert"},
            {"type": "order", "key": "o-1", "value": 1, "headers": {"operation": "upsert"}},
            {"type": "order", "key": "", "value": 1, "headers": {"operation": "insert"}},
            {"type": "", "key": "o-1", "value": 1, "headers": {"operation": "insert"}},
            {"key": "o-1", "value": 1, "headers": {"operation": "insert"}},
            {"type": "order", "key": 7, "value": 1, "headers": {"operation": "insert"}},
            {"type": "order", "key": "o-1", "headers": {"operation": "update"}},  # no value
            {"type": "order", "key": "o-1", "value": 1, "headers": {}},
            {"headers": {"control": "reset", "operation": "delete"}},
            {"headers": {"control": "rewind"}},
            # An invalid reset must not clear anything.
            {"headers": {"control": "reset", "offset": "a,b"}},
            {"headers": {"control": "reset", "offset": ""}},
            change("order", "o-2", 1, txid=""),
            change("order", "o-3", 1, timestamp="yesterday"),
            change("order", "o-4", 1, timestamp="2025-02-30T10:00:00Z"),
            change("order", "o-5", "NUL \u0000 inside"),  # jsonb cannot hold it
            change("order", "lone \ud800 surrogate", 1),
        ]
    )


def schema_violation(rng: random.Random) -> dict:
    """A user change that USER_SCHEMA refuses."""
    key = f"user-{rng.randrange(1500)}"
    value = rng.choice([{"age": 3}, {"name": 5}, {"name": "x", "age": -1}, "x", None, []])
    return change("user", key, value, rng.choice(["insert", "update"]))


def history(
    rng: random.Random,
    count: int,
    *,
    keys_per_type: int = 1500,
    resets_at: tuple[int, ...] = (),
    invalid_rate: float = 0.0,
) -> list[Any]:
    """``count`` messages: inserts, updates (of keys seen before) and deletes over TYPES,
    no-op control events, a reset at each index of ``resets_at``, and with probability
    ``invalid_rate`` per message a malformed event or a user that fails USER_SCHEMA."""
    seen: list[tuple[str, str]] = []
    events: list[Any] = []
    for index in range(count):
        roll = rng.random()
        if index in resets_at:
            events.append(control("reset"))
        elif roll < invalid_rate / 2:
            events.append(malformed(rng))
        elif roll < invalid_rate:
            events.append(schema_violation(rng))
        elif roll < invalid_rate + 0.002:
            kind = rng.choice(["snapshot-start", "snapshot-end", "up-to-date"])
            events.append({"headers": {"control": kind, "offset": "0000000000000001_x"}})
        else:
            type_name = rng.choice(TYPES)
            if seen and rng.random() < 0.45:
                type_name, key = rng.choice(seen)
                op = "delete" if rng.random() < 0.35 else "update"
            else:
                if rng.random() < 0.01:
                    key = rng.choice(ODD_KEYS)
                else:
                    key = f"{type_name}-{rng.randrange(keys_per_type)}"
                op = "insert"
                seen.append((type_name, key))
            headers: dict[str, Any] = {}
            if rng.random() < 0.1:
                headers = {"txid": f"tx-{index}", "timestamp": "2025-01-02T03:04:05.678+01:00"}
            value = random_value(rng, type_name)
            events.append(change(type_name, key, value, op, **headers))
    return events
