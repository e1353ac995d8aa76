"""Streams as tables (issue 16): a sunk stream's messages become rows of a table, exactly once,
in stream order, with their offsets, whatever happens to the server processes applying them;
messages that do not fit are recorded (offset, error) and skipped; a State Protocol stream
upserts and deletes rows by key (STATE-PROTOCOL.md 6), a reset empties the table (4.2.2).

Appends go through real servers over HTTP; operators use the real commands; the table is read
straight from the test database.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx
import psycopg

from tests.conftest import ServerProcess
from tests.state.support import change, control, model, read_messages, register_ok
from tests.tablesync.support import (
    command_fails,
    command_ok,
    csrf,
    table_state,
    wait_until,
)

JSON = {"Content-Type": "application/json"}


def unique(name: str) -> str:
    return f"{name}_{time.time_ns()}"


def sink_row(pg: psycopg.Connection[Any], path: str) -> dict[str, Any]:
    row = pg.execute(
        "SELECT k.id, k.applied_seq, k.state, k.error_count, k.last_error, s.next_seq"
        " FROM ds_stream_sink AS k LEFT JOIN ds_stream AS s ON s.id = k.stream_id"
        " WHERE k.stream_path = %s",
        [path],
    ).fetchone()
    assert row is not None, path
    names = ["id", "applied_seq", "state", "errors", "last_error", "tail"]
    return dict(zip(names, row, strict=True))


def caught_up(pg: psycopg.Connection[Any], path: str) -> bool:
    sink = sink_row(pg, path)
    return sink["applied_seq"] == sink["tail"]


def sink_messages(
    client: httpx.Client,
    pg: psycopg.Connection[Any],
    database_url: str,
    path: str,
    messages: list[Any],
    table_ddl: str,
    *maps: str,
) -> None:
    """A JSON stream of ``messages`` at ``path``, a table made by ``table_ddl``, and an append
    sink of one into the other (its ``--map`` options ``maps``), caught up."""
    assert client.put(f"/v1/stream/{path}", headers=JSON, content=json.dumps(messages)).is_success
    pg.execute(table_ddl)
    table = table_ddl.split()[2]
    options = [option for column in maps for option in ("--map", column)]
    command_ok(database_url, "sink_stream", path, "--table", table, *options, "--wait")
    wait_until(lambda: caught_up(pg, path), "the sink applies the stream")


def sink_sqlstates(pg: psycopg.Connection[Any], path: str) -> list[tuple[str]]:
    """The SQLSTATE of each message the sink of ``path`` recorded as a misfit, in stream order."""
    return pg.execute(
        "SELECT e.sqlstate FROM ds_sink_error AS e JOIN ds_stream_sink AS k ON k.id = e.sink_id"
        " WHERE k.stream_path = %s ORDER BY e.seq",
        [path],
    ).fetchall()


def stored_messages(pg: psycopg.Connection[Any], path: str) -> list[tuple[str, Any]]:
    """(offset, message) of every message of the stream, in stream order."""
    rows = pg.execute(
        "SELECT ds_offset(m.seq, m.pos), convert_from(m.data, 'UTF8') FROM ds_message AS m"
        " JOIN ds_stream AS s ON s.id = m.stream_id WHERE s.path = %s ORDER BY m.seq",
        [path],
    ).fetchall()
    return [(offset, json.loads(text)) for offset, text in rows]


def fits(message: Any) -> bool:
    """Does a message of the producers below fit the mapping (n a bigint, body text)?"""
    return (
        isinstance(message, dict)
        and isinstance(message.get("n"), int)
        and isinstance(message.get("body", ""), str)
    )


class Producers:
    """Idempotent producers (PROTOCOL.md 5.2.1) appending through whichever servers are up:
    a request whose connection fails is retried, with the same sequence number, on the next
    server, until it is acknowledged, so each message is stored exactly once."""

    def __init__(self, servers: list[ServerProcess], path: str, count: int, appends: int) -> None:
        self.servers = servers
        self.path = path
        self.count = count
        self.appends = appends
        self.errors: list[Exception] = []
        self.retries = 0
        self.threads = [threading.Thread(target=self._run, args=(p,)) for p in range(count)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join()
        assert not self.errors, self.errors

    def _run(self, producer: int) -> None:
        rng = random.Random(producer)
        try:
            with httpx.Client(timeout=30) as client:
                for seq in range(self.appends):
                    batch = [self._message(rng, producer, seq, i) for i in range(rng.randint(1, 4))]
                    self._append(client, producer, seq, batch)
        except Exception as exc:  # noqa: BLE001 - reported by join()
            self.errors.append(exc)

    @staticmethod
    def _message(rng: random.Random, producer: int, seq: int, i: int) -> Any:
        roll = rng.random()
        n = seq * 10 + i
        if roll < 0.03:
            return f"not an object {producer}-{n}"
        if roll < 0.06:
            return {"producer": f"p{producer}", "n": f"{n} is not a bigint", "body": "x"}
        if roll < 0.08:
            return {"producer": f"p{producer}", "n": n, "body": {"not": "text"}}
        return {"producer": f"p{producer}", "n": n, "body": f"message {n} of p{producer} ✓"}

    def _append(self, client: httpx.Client, producer: int, seq: int, batch: list[Any]) -> None:
        headers = {
            **JSON,
            "Producer-Id": f"p{producer}",
            "Producer-Epoch": "0",
            "Producer-Seq": str(seq),
        }
        for attempt in range(200):
            server = self.servers[(producer + attempt) % len(self.servers)]
            try:
                response = client.post(
                    server.stream_url(self.path), headers=headers, content=json.dumps(batch)
                )
            except httpx.TransportError:
                self.retries += 1
                time.sleep(0.05)
                continue
            if response.status_code == 503:
                self.retries += 1
                time.sleep(0.05)
                continue
            assert response.status_code in (200, 204), response.text
            return
        raise AssertionError(f"p{producer} seq {seq} never acknowledged")


def test_sink_under_concurrent_appends_survives_kill_9(
    start_server: Any, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """8 idempotent producers append through two servers while both apply the sink; one server
    is killed with kill -9 during the appends, then the other in the middle of a backlog, and
    a new one takes over. The table ends holding exactly the stream's messages that fit, once
    each, inserted in stream order with their offsets; the others are recorded errors."""
    env = {"DS_TABLESYNC__SINK_BATCH_MESSAGES": "40", "DS_TABLESYNC__SWEEP_INTERVAL_SECS": "1"}
    a, b = start_server(env=env), start_server(env=env)
    path = f"tablesync/{unique('sunk')}"
    table = unique("sunk")
    assert httpx.put(a.stream_url(path), headers=JSON).status_code == 201
    pg.execute(
        f"CREATE TABLE {table} (row_id bigserial UNIQUE, producer text NOT NULL, n bigint,"
        " body text, stream_offset text PRIMARY KEY)"
    )
    # The table's own trigger makes every row cost a millisecond, so that applying a backlog
    # takes long enough for a kill to land in the middle of it.
    pg.execute(
        f"CREATE FUNCTION {table}_slow() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN PERFORM pg_sleep(0.001); RETURN NEW; END $$"
    )
    pg.execute(
        f"CREATE TRIGGER slow BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {table}_slow()"
    )
    command_ok(
        database_url, "sink_stream", path, "--table", table,
        "--map", "producer::text", "--map", "n::bigint", "--map", "body::text",
    )  # fmt: skip

    servers = [a, b]
    producers = Producers(servers, path, count=8, appends=40)
    producers.start()
    wait_until(
        lambda: sink_row(pg, path)["applied_seq"] > 20, "the sink applies while appends go on"
    )
    a.process.kill()  # kill -9 of one server while it appends and sinks
    a.process.wait()
    servers.remove(a)
    producers.join()

    # A backlog, then kill -9 of the remaining server in the middle of applying it.
    backlog = [{"producer": "bulk", "n": i, "body": f"bulk {i}"} for i in range(3000)]
    assert httpx.post(b.stream_url(path), headers=JSON, content=json.dumps(backlog)).is_success
    before = sink_row(pg, path)["applied_seq"]
    wait_until(lambda: sink_row(pg, path)["applied_seq"] > before, "the backlog is being applied")
    b.process.kill()
    b.process.wait()
    at_kill = sink_row(pg, path)
    assert at_kill["applied_seq"] < at_kill["tail"], "the kill did not land in the middle"

    # A new server takes over (after the killed one's transaction is gone) while more appends
    # arrive through it.
    c = start_server(env=env)
    servers[:] = [c]
    more = Producers(servers, path, count=4, appends=10)
    more.start()
    more.join()
    wait_until(lambda: caught_up(pg, path), "the sink reaches the stream's tail")

    stored = stored_messages(pg, path)
    with httpx.Client(base_url=c.base_url, timeout=30) as client:
        over_http, _ = read_messages(client, path)
    assert [m for _, m in stored] == over_http
    expected = [(m["producer"], m["n"], m.get("body"), offset) for offset, m in stored if fits(m)]
    rows = pg.execute(
        f"SELECT producer, n, body, stream_offset FROM {table} ORDER BY row_id"
    ).fetchall()
    assert rows == expected  # each message once, inserted in stream order
    errors = pg.execute(
        "SELECT e.message_offset, e.sqlstate FROM ds_sink_error AS e"
        " JOIN ds_stream_sink AS k ON k.id = e.sink_id WHERE k.stream_path = %s ORDER BY e.seq",
        [path],
    ).fetchall()
    misfits = [offset for offset, m in stored if not fits(m)]
    assert [offset for offset, _ in errors] == misfits
    assert {state for _, state in errors} <= {"22023", "22P02"}
    sink = sink_row(pg, path)
    assert sink["errors"] == len(misfits) and sink["last_error"] == ""
    assert len(rows) + len(misfits) == len(stored) > 3000
    print(
        f"[tablesync] {len(stored)} messages, {len(rows)} rows, {len(misfits)} misfits;"
        f" second kill at {at_kill['applied_seq']} of {at_kill['tail']};"
        f" {producers.retries + more.retries} append retries"
    )


def test_malformed_messages_are_recorded_and_shown_in_the_admin(
    client: httpx.Client, admin_client: httpx.Client, pg: psycopg.Connection[Any],
    database_url: str,
) -> None:  # fmt: skip
    """A sink bound in the admin (table created from the mapping) skips messages that do not
    fit: each is recorded with its offset and error, shown on the sink's page and in the sink
    errors list; the sink goes on with the next messages."""
    path = f"tablesync/{unique('admin')}"
    table = unique("admin_sink")
    messages = [
        {"order": {"id": 1, "total": 9.5}, "note": "first"},
        {"order": {"id": "one", "total": 1}, "note": "id is not a number"},
        ["not", "an", "object"],
        {"order": {"id": 3, "total": "lots"}, "note": "total is not numeric"},
        {"order": {"id": 4}, "note": {"an": "object"}},
        {"order": {"id": 5, "total": 0.25}},
    ]
    assert client.put(f"/v1/stream/{path}", headers=JSON, content=json.dumps(messages)).is_success
    add_url = "/admin/tablesync/streamsink/add/"
    response = admin_client.post(
        add_url,
        data={
            "csrfmiddlewaretoken": csrf(admin_client, add_url),
            "stream_path_field": path,
            "table": table,
            "mapping_lines": "order_id=order.id::bigint\ntotal=order.total::numeric\nnote::text",
            "sink_mode": "append",
            "offset_column_name": "stream_offset",
            "start": "-1",
            "create_table": "on",
        },
        headers={"Referer": admin_client.base_url.join(add_url).__str__()},
    )
    assert response.status_code == 200
    assert "was added successfully" in response.text, response.text[-3000:]
    wait_until(lambda: caught_up(pg, path), "the sink applies the stream")
    rows = pg.execute(
        f"SELECT order_id, total, note FROM {table} ORDER BY stream_offset"
    ).fetchall()
    assert [(r[0], float(r[1]) if r[1] is not None else None, r[2]) for r in rows] == [
        (1, 9.5, "first"),
        (5, 0.25, None),
    ]
    stored = stored_messages(pg, path)
    bad_offsets = [stored[i][0] for i in (1, 2, 3, 4)]
    sink = sink_row(pg, path)
    page = admin_client.get(f"/admin/tablesync/streamsink/{sink['id']}/change/")
    assert page.status_code == 200
    for offset in bad_offsets:
        assert offset in page.text
    assert "invalid input syntax for type bigint" in page.text
    assert "expected a JSON object" in page.text
    assert "expected a string" in page.text
    errors = admin_client.get(f"/admin/tablesync/sinkerror/?sink__id__exact={sink['id']}")
    assert errors.status_code == 200
    assert all(offset in errors.text for offset in bad_offsets)

    # The same form refuses what cannot work, and creates nothing.
    response = admin_client.post(
        add_url,
        data={
            "csrfmiddlewaretoken": csrf(admin_client, add_url),
            "stream_path_field": path,
            "table": unique("missing"),
            "mapping_lines": "note::text",
            "sink_mode": "append",
            "offset_column_name": "stream_offset",
            "start": "-1",
        },
    )
    assert response.status_code == 200 and "not found" in response.text
    assert pg.execute(
        "SELECT count(*) FROM ds_stream_sink WHERE stream_path = %s", [path]
    ).fetchone() == (1,)


def test_state_stream_upserts_and_deletes_rows_by_key(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """A registered State Protocol stream sunk by key into a user table: inserts and updates
    upsert, deletes delete, a reset empties the table, events of other types are left out;
    a value that does not fit is recorded and a later valid change of its key still applies.
    The table equals the state of the stream's `user` entities (the spec's model and the
    server's own materialization)."""
    path = f"tablesync/{unique('state')}"
    table = unique("users")
    client.put(f"/v1/stream/{path}", headers=JSON)
    register_ok(client, path)
    rng = random.Random(16)
    events: list[dict[str, Any]] = []
    for i in range(300):
        key = f"u{rng.randint(0, 30)}"
        roll = rng.random()
        if roll < 0.2:
            events.append(change("user", key, op="delete"))
        elif roll < 0.3:
            events.append(change("message", f"m{i}", {"text": "other type"}))
        else:
            op = "insert" if roll < 0.6 else "update"
            events.append(change("user", key, {"name": f"name {i}", "age": rng.randint(0, 99)}, op))
        if i == 120:
            events.append(control("reset"))
    events.append(change("user", "u1", {"name": "bad age", "age": "ninety"}, "update"))
    events.append(change("user", "u1", {"name": "good age", "age": 90}, "update"))
    for start in range(0, len(events), 50):
        response = client.post(
            f"/v1/stream/{path}", headers=JSON, content=json.dumps(events[start : start + 50])
        )
        assert response.status_code in (200, 204), response.text
    command_ok(
        database_url, "sink_stream", path, "--table", table, "--create", "--mode", "upsert",
        "--key", "id", "--type", "user", "--map", "name::text", "--map", "age::int", "--wait",
    )  # fmt: skip
    wait_until(lambda: caught_up(pg, path), "the sink applies the stream")

    users = {k: v for k, v in model([e for e in events if e.get("type") != "message"]).items()}
    misfit = {"name": "bad age", "age": "ninety"}
    assert misfit not in users.values()
    rows = pg.execute(f"SELECT id, name, age FROM {table}").fetchall()
    assert {("user", k): {"name": n, "age": a} for k, n, a in rows} == users
    errors = pg.execute(
        "SELECT e.message FROM ds_sink_error AS e JOIN ds_stream_sink AS k ON k.id = e.sink_id"
        " WHERE k.stream_path = %s",
        [path],
    ).fetchall()
    assert [json.loads(m)["value"] for (m,) in errors] == [misfit]
    entities = client.get("/v1/state/entities", params={"stream": path, "type": "user",
                                                        "page_size": 1000}).json()  # fmt: skip
    served = {("user", e["key"]): e["value"] for e in entities["results"]}
    assert served == users | {("user", "u1"): {"name": "good age", "age": 90}}


def test_round_trip_table_to_stream_to_table(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """Both directions at once: table A published (with a snapshot) to a stream, the stream
    sunk by key into table B. After inserts, updates, deletes and a rolled-back transaction
    on A, B equals A."""
    source = unique("source")
    replica = unique("replica")
    path = f"tablesync/{source}"
    pg.execute(f"CREATE TABLE {source} (id bigint PRIMARY KEY, title text, stock int)")
    pg.execute(f"INSERT INTO {source} SELECT g, 'item ' || g, g FROM generate_series(1, 50) g")
    command_ok(database_url, "publish_table", source, "--stream", path, "--snapshot")
    command_ok(
        database_url, "sink_stream", path, "--table", replica, "--create", "--mode", "upsert",
        "--key", "id::bigint", "--map", "title::text", "--map", "stock::int",
        "--no-offset-column",
    )  # fmt: skip
    with psycopg.connect(database_url) as app:
        app.execute(f"UPDATE {source} SET stock = stock - 1 WHERE id % 3 = 0")
        app.execute(f"DELETE FROM {source} WHERE id > 45")
        app.execute(f"INSERT INTO {source} VALUES (100, 'new', 1)")
        app.commit()
        app.execute(f"DELETE FROM {source}")
        app.rollback()
    wait_until(lambda: caught_up(pg, path), "the replica catches up")
    replica_rows = pg.execute(f"SELECT id, title, stock FROM {replica} ORDER BY id").fetchall()
    assert replica_rows == pg.execute(f"SELECT * FROM {source} ORDER BY id").fetchall()
    assert len(replica_rows) == 46
    assert table_state(pg, replica, "x").keys() == table_state(pg, source, "x").keys()


def test_sink_refuses_what_it_cannot_apply(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """Operator mistakes get a clear error and create nothing: a missing or non-JSON stream, a
    fork, a missing table or column, a type that differs from the column's, an upsert key
    without a unique index, a NOT NULL column left out, a bad offset, a bad mapping, an
    existing table with --create, the server's own tables."""
    path = f"tablesync/{unique('refusals')}"
    text_path = f"tablesync/{unique('text')}"
    fork_path = f"tablesync/{unique('fork')}"
    table = unique("target")
    client.put(f"/v1/stream/{path}", headers=JSON, content="[1, 2]")
    client.put(f"/v1/stream/{text_path}", headers={"Content-Type": "text/plain"})
    client.put(f"/v1/stream/{fork_path}", headers={**JSON, "Stream-Forked-From": path})
    pg.execute(f"CREATE TABLE {table} (id int, label text NOT NULL, stream_offset text)")
    cases = [
        ((f"{path}-missing", "--table", table, "--map", "label"), "not found"),
        ((text_path, "--table", table, "--map", "label"), "not application/json"),
        ((fork_path, "--table", table, "--map", "label"), "is a fork"),
        ((path, "--table", unique("nope"), "--map", "label"), "not found"),
        ((path, "--table", table, "--map", "nope"), "has no column 'nope'"),
        ((path, "--table", table, "--map", "label::int"), "is text, the mapping says int"),
        ((path, "--table", table, "--map", "label::no_such_type"), "unknown type"),
        ((path, "--table", table, "--map", "id"), "NOT NULL without a default"),
        ((path, "--table", table, "--map", "label", "--mode", "upsert", "--key", "id"),
         "no unique index"),
        ((path, "--table", table, "--map", "label", "--from", "0000000000000009_0000000000000000"),
         "not an offset"),
        ((path, "--table", table, "--map", "label", "--from", "soon"), "malformed offset"),
        ((path, "--table", table, "--map", "label=a..b"), "empty key"),
        ((path, "--table", table, "--map", "label", "--map", "label"), "mapped twice"),
        ((path, "--table", table, "--map", "label", "--create"), "already exists"),
        ((path, "--table", "ds_message", "--map", "data"), "own tables"),
        ((path, "--table", "auth_user", "--map", "username"), "own tables (auth)"),
        ((path, "--table", "yjs_document", "--map", "name"), "own tables (yjs)"),
        ((path, "--table", table, "--map", "label", "--offset-column", "label"), "must differ"),
        ((path, "--table", table, "--map", "label", "--key", "id"), "upsert"),
    ]  # fmt: skip
    for args, message in cases:
        assert message in command_fails(database_url, "sink_stream", *args), args
    assert pg.execute(
        "SELECT count(*) FROM ds_stream_sink WHERE stream_path IN (%s, %s, %s)",
        [path, text_path, fork_path],
    ).fetchone() == (0,)
    command_ok(database_url, "sink_stream", path, "--table", table, "--map", "label")
    assert "already sunk" in command_fails(
        database_url, "sink_stream", path, "--table", table, "--map", "label"
    )


def test_sink_from_now_and_a_deleted_stream(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """--from now applies only later messages; when the stream is deleted the sink stops
    (state `stream_gone`) and keeps its rows; unsink_stream removes it."""
    path = f"tablesync/{unique('later')}"
    table = unique("later")
    client.put(f"/v1/stream/{path}", headers=JSON, content=json.dumps([{"v": "before"}]))
    command_ok(
        database_url, "sink_stream", path, "--table", table, "--create", "--map", "v::text",
        "--from", "now",
    )  # fmt: skip
    client.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps([{"v": "after"}]))
    wait_until(lambda: caught_up(pg, path), "the sink applies the new message")
    assert pg.execute(f"SELECT v FROM {table}").fetchall() == [("after",)]
    assert client.delete(f"/v1/stream/{path}").status_code == 204
    wait_until(lambda: sink_row(pg, path)["state"] == "stream_gone", "the sink sees the delete")
    status = json.loads(command_ok(database_url, "tablesync_status", "--json"))
    assert any(s["stream"] == path and s["state"] == "stream_gone" for s in status["sinks"])
    command_ok(database_url, "unsink_stream", path, "--table", table)
    assert pg.execute(f"SELECT v FROM {table}").fetchall() == [("after",)]


def _sunk_stream(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str, name: str
) -> tuple[str, str]:
    """A JSON stream holding {"v": "a0"}, sunk into a new table that has applied it."""
    path = f"tablesync/{unique(name)}"
    table = unique(name)
    client.put(f"/v1/stream/{path}", headers=JSON, content=json.dumps([{"v": "a0"}]))
    command_ok(database_url, "sink_stream", path, "--table", table, "--create", "--map", "v::text")
    wait_until(lambda: caught_up(pg, path), "the sink applies the first message")
    return path, table


def _append_and_trim(client: httpx.Client, path: str) -> list[str]:
    """Append a1 to a5, then trim before a4; the offsets after each append."""
    offsets = []
    for n in range(1, 6):
        response = client.post(
            f"/v1/stream/{path}", headers=JSON, content=json.dumps([{"v": f"a{n}"}])
        )
        offsets.append(response.headers["Stream-Next-Offset"])
    trimmed = client.post(f"/v1/stream/{path}", headers={"Stream-Trim-Before": offsets[2]})
    assert trimmed.status_code == 204, trimmed.text
    return offsets


def test_a_sink_behind_a_trim_records_the_gap_and_goes_on(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """Messages trimmed (and purged) before a paused sink applied them are gone for every
    reader: on resuming, the sink records the gap once, as an error with its offsets, and
    applies what the stream still holds; a sink bound from the beginning of a trimmed stream
    starts at its first retained message, with no gap to record."""
    path, table = _sunk_stream(client, pg, database_url, "trimmed")
    pg.execute("UPDATE ds_stream_sink SET state = 'paused' WHERE stream_path = %s", [path])
    # Trim before a4: a1 to a3 go, and are purged (no fork reads them).
    offsets = _append_and_trim(client, path)
    wait_until(lambda: [m["v"] for _, m in stored_messages(pg, path)] == ["a4", "a5"], "the purge")
    pg.execute("UPDATE ds_stream_sink SET state = 'active' WHERE stream_path = %s", [path])
    wait_until(lambda: caught_up(pg, path), "the resumed sink reaches the tail")
    assert pg.execute(f"SELECT v FROM {table} ORDER BY v").fetchall() == [("a0",), ("a4",), ("a5",)]
    sink = sink_row(pg, path)
    assert sink["state"] == "active" and sink["errors"] == 1
    errors = pg.execute(
        "SELECT seq, error FROM ds_sink_error WHERE sink_id = %s", [sink["id"]]
    ).fetchall()
    assert len(errors) == 1 and errors[0][0] == 1 and "3 messages" in errors[0][1], errors
    assert offsets[2] in errors[0][1]

    # Bound from the beginning of the trimmed stream: its retained messages, no error.
    again = unique("trimmed")
    command_ok(database_url, "sink_stream", path, "--table", again, "--create", "--map", "v::text")
    wait_until(
        lambda: pg.execute(f"SELECT count(*) FROM {again}").fetchone()[0] == 2,  # type: ignore[index]
        "the second sink applies the retained messages",
    )
    row = pg.execute(
        "SELECT error_count FROM ds_stream_sink WHERE stream_path = %s AND table_name = %s",
        [path, again],
    ).fetchone()
    assert row == (0,)


def test_the_purge_keeps_rows_a_running_sink_has_not_applied(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """A sink's run reads the stream's start, then its rows: a trim and purge that commit in
    between made it skip rows without recording them. So the purge keeps a stream's rows from
    its least advanced active sink. Here a run is "in progress" (the test holds the sink's row
    lock, as a run does) across a trim: the purge leaves the trimmed rows and comes back later;
    once the sink has recorded the gap and moved past it, the rows are purged."""
    path, table = _sunk_stream(client, pg, database_url, "held")
    with psycopg.connect(database_url) as run:
        run.execute("SELECT 1 FROM ds_stream_sink WHERE stream_path = %s FOR UPDATE", [path])
        _append_and_trim(client, path)

        def purge_came_by() -> bool:
            # Gone from the queue (purged), or due again in about 10 s (held
            # back): neither due now (not yet claimed) nor claimed (due in the 60 s lease).
            row = pg.execute(
                "SELECT extract(epoch FROM q.due_at - now()) FROM ds_purge_pending AS q"
                " JOIN ds_stream AS s ON s.id = q.stream_id WHERE s.path = %s",
                [path],
            ).fetchone()
            return row is None or 1 < row[0] < 11

        wait_until(purge_came_by, "the purge of the trimmed rows")
        kept = [m["v"] for _, m in stored_messages(pg, path)]
        assert kept == ["a1", "a2", "a3", "a4", "a5"], kept  # a0 was applied: purged
        run.rollback()  # the run ends
    client.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps([{"v": "a6"}]))
    wait_until(lambda: caught_up(pg, path), "the sink reaches the tail")
    applied = pg.execute(f"SELECT v FROM {table} ORDER BY v").fetchall()
    assert applied == [("a0",), ("a4",), ("a5",), ("a6",)], applied
    assert sink_row(pg, path)["errors"] == 1  # the gap, recorded
    # The purge comes back (10 s later; here at once) and finds nothing held back.
    pg.execute(
        "UPDATE ds_purge_pending SET due_at = now()"
        " WHERE stream_id = (SELECT id FROM ds_stream WHERE path = %s)",
        [path],
    )
    command_ok(database_url, "trim_streams")
    assert [m["v"] for _, m in stored_messages(pg, path)] == ["a4", "a5", "a6"]


def test_a_failing_sink_does_not_hold_the_purge_back(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """A sink whose runs fail (its table gone, say: last_error) could hold a stream's purge off
    for good; it holds nothing, even with a run of it in progress (the sink's row locked)."""
    path, _ = _sunk_stream(client, pg, database_url, "failing")
    pg.execute(
        "UPDATE ds_stream_sink SET last_error = 'relation does not exist' WHERE stream_path = %s",
        [path],
    )
    with psycopg.connect(database_url) as run:
        run.execute("SELECT 1 FROM ds_stream_sink WHERE stream_path = %s FOR UPDATE", [path])
        _append_and_trim(client, path)
        wait_until(
            lambda: [m["v"] for _, m in stored_messages(pg, path)] == ["a4", "a5"], "the purge"
        )
        run.rollback()


def test_values_past_an_index_are_skipped_not_retried(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """A message whose value is more than a btree index holds (class 54) is recorded and
    skipped like any other misfit: the messages around it are applied. Before, it failed every
    run for good, and the sink stood still (found by an adversarial probe)."""
    path = f"tablesync/{unique('limits')}"
    table = unique("limits_sink")
    messages = [
        {"name": "first", "ref": 1},
        {"name": "".join(random.choices("abcdefghij", k=9000)), "ref": 2},
        {"name": "third", "ref": 3},
    ]
    sink_messages(
        client, pg, database_url, path, messages,
        f"CREATE TABLE {table} (name text UNIQUE, ref int, stream_offset text)",
        "name::text", "ref::int",
    )  # fmt: skip
    rows = pg.execute(f"SELECT name, ref FROM {table} ORDER BY stream_offset").fetchall()
    assert rows == [("first", 1), ("third", 3)]
    assert sink_sqlstates(pg, path) == [("54000",)]


def test_a_table_and_its_stream_cannot_feed_each_other(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """A table published to a stream that is also sunk into it publishes each row the sink
    writes again, without end (a soak probe saw 400 messages a second from one insert):
    whichever of the two comes second is refused, and nothing of it is made."""
    first, second = unique("loop_pub"), unique("loop_sink")
    for table in (first, second):
        pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, stream_offset text)")
    command_ok(database_url, "publish_table", first, "--stream", f"tablesync/{first}")
    error = command_fails(
        database_url, "sink_stream", f"tablesync/{first}", "--table", first, "--map", "id::int"
    )
    assert "without end" in error, error
    assert client.put(f"/v1/stream/tablesync/{second}", headers=JSON).status_code == 201
    command_ok(
        database_url, "sink_stream", f"tablesync/{second}", "--table", second, "--map", "id::int"
    )
    error = command_fails(database_url, "publish_table", second, "--stream", f"tablesync/{second}")
    assert "without end" in error, error
    assert pg.execute(
        "SELECT count(*) FROM ds_table_publication WHERE table_name = %s", [second]
    ).fetchone() == (0,)
    command_ok(database_url, "unpublish_table", first)


def test_fixed_length_columns_take_whole_values_or_record_a_misfit(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """``character(n)`` and ``bit(n)`` columns: values were cast to the type without its length,
    which for these two means a length of 1, so "USD" was stored as "U" without a word and
    every bit string of three bits was refused (found by a probe). Now a value of the right
    length is stored whole, and one too long is recorded and skipped."""
    path = f"tablesync/{unique('fixed')}"
    table = unique("fixed_sink")
    messages = [{"currency": "USD", "flags": "101"}, {"currency": "EURO", "flags": "110"}]
    sink_messages(
        client, pg, database_url, path, messages,
        f"CREATE TABLE {table} (currency char(3), flags bit(3), stream_offset text)",
        "currency::character", "flags::bit",
    )  # fmt: skip
    rows = pg.execute(f"SELECT currency, flags::text FROM {table}").fetchall()
    assert rows == [("USD", "101")]
    assert sink_sqlstates(pg, path) == [("22001",)]


def test_an_upsert_sink_keyed_by_a_fixed_length_column_deletes_its_rows(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """Keys of a ``character(n)`` column arrive blank-padded ("US " from a published char(3)
    key): the first fix cast them to text, where "US" and "US " differ, so a delete of "US "
    deleted nothing, without a word (found by review). They compare as the column does now.
    And a domain over varchar(3) took "EURO" as "EUR" (the cast to the domain cut it): now a
    misfit, recorded."""
    path = f"tablesync/{unique('padded')}"
    table = unique("padded_sink")
    client.put(f"/v1/stream/{path}", headers=JSON)
    register_ok(client, path)
    events = [
        change("country", "US ", {"name": "United States"}),
        change("country", "FRA", {"name": "France"}),
    ]
    assert client.post(f"/v1/stream/{path}", headers=JSON, content=json.dumps(events)).is_success
    pg.execute(f"CREATE TABLE {table} (code char(3) PRIMARY KEY, name text, stream_offset text)")
    command_ok(
        database_url, "sink_stream", path, "--table", table, "--mode", "upsert", "--key", "code",
        "--type", "country", "--map", "name::text", "--wait",
    )  # fmt: skip
    wait_until(lambda: caught_up(pg, path), "the sink applies the stream")
    assert len(pg.execute(f"SELECT code FROM {table}").fetchall()) == 2
    deleted = json.dumps([change("country", "US ", op="delete")])
    assert client.post(f"/v1/stream/{path}", headers=JSON, content=deleted).is_success
    wait_until(lambda: caught_up(pg, path), "the sink applies the delete")
    assert pg.execute(f"SELECT code, name FROM {table}").fetchall() == [("FRA", "France")]

    domain, other, other_path = unique("code3"), unique("domain_sink"), f"{path}-domain"
    pg.execute(f"CREATE DOMAIN {domain} AS varchar(3)")
    sink_messages(
        client, pg, database_url, other_path, [{"code": "USD"}, {"code": "EURO"}],
        f"CREATE TABLE {other} (code {domain}, stream_offset text)", "code",
    )  # fmt: skip
    assert pg.execute(f"SELECT code FROM {other}").fetchall() == [("USD",)]
