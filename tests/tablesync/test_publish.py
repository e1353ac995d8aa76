"""Tables as streams (issue 16): a published table's committed changes reach its stream as State
Protocol change events (STATE-PROTOCOL.md 4.1, 5.1), in commit order, exactly once, in the
transaction that makes them; read back by catch-up (PROTOCOL.md 5.6), SSE (5.8) and the
reference clients (@durable-streams/client + @durable-streams/state), whose state must equal
the table's.

Tables are written with psycopg straight to the test database, as an application would; the
operator's side is the real ``manage.py`` commands; reads go through a real server over HTTP.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import JS_DIR, ServerProcess, run_node
from tests.state.support import read_messages
from tests.tablesync.support import (
    SseReader,
    command_fails,
    command_ok,
    csrf,
    entities_state,
    stream_state,
    table_state,
    wait_until,
)

MATERIALIZE = JS_DIR / "state" / "materialize.mjs"
FOLLOW = JS_DIR / "state" / "follow.mjs"


def unique(name: str) -> str:
    return f"{name}_{time.time_ns()}"


def create_items_table(pg: psycopg.Connection[Any], table: str) -> None:
    pg.execute(
        f"CREATE TABLE {table} (id bigint PRIMARY KEY, name text NOT NULL, price numeric,"
        " tags text[], attrs jsonb, active boolean DEFAULT true,"
        " updated_at timestamptz DEFAULT now(), version int NOT NULL DEFAULT 1)"
    )


def test_published_table_reads_back_through_catch_up_sse_and_reference_clients(
    server: ServerProcess,
    client: httpx.Client,
    pg: psycopg.Connection[Any],
    database_url: str,
) -> None:
    """Inserts, updates (one row, many rows, a primary key), deletes and a rolled-back
    transaction: the stream holds exactly the committed changes, and the state that catch-up,
    SSE, the reference client's catch-up and its live SSE subscription materialize equals the
    table, row for row."""
    table = unique("items")
    path = f"tablesync/{table}"
    create_items_table(pg, table)
    pg.execute(
        f"INSERT INTO {table} (id, name, price, tags, attrs) VALUES"
        " (1, 'apple', 1.25, '{red,fruit}', '{\"origin\": \"NZ\"}'),"
        " (2, 'pear', NULL, NULL, NULL), (3, 'plum', 0.5, '{}', '[1, 2]')"
    )
    out = command_ok(database_url, "publish_table", table, "--stream", path, "--snapshot")
    assert "3 rows in the snapshot" in out
    # Followers from the very beginning, connected before any change: SSE, and the reference
    # client subscribing live over SSE.
    sse = SseReader(server.base_url, path)
    sse.start()
    assert sse.connected.wait(30)

    rolled_back_key = "900"
    with psycopg.connect(database_url) as app:
        with app.transaction():
            app.execute(f"INSERT INTO {table} (id, name, price) VALUES (4, 'fig', 3)")
            app.execute(f"UPDATE {table} SET price = 2.5, version = version + 1 WHERE id = 1")
        app.execute(  # one statement, many rows
            f"UPDATE {table} SET active = false, version = version + 1 WHERE id IN (2, 3, 4)"
        )
        app.commit()
        with app.transaction():  # a primary key changes: a delete and an insert
            app.execute(f"UPDATE {table} SET id = 30 WHERE id = 3")
            app.execute(f"DELETE FROM {table} WHERE id = 2")
        try:
            with app.transaction():
                app.execute(f"INSERT INTO {table} (id, name) VALUES ({rolled_back_key}, 'never')")
                app.execute(f"UPDATE {table} SET name = 'never either' WHERE id = 1")
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        app.execute(f"UPDATE {table} SET name = name WHERE id = 1")  # no published change
        app.commit()
        app.execute(
            f"INSERT INTO {table} (id, name, attrs) SELECT g, 'bulk ' || g,"
            " jsonb_build_object('n', g, 'quote', 'it''s \"x\"', 'uni', 'h\u00e9 \u2713')"
            " FROM generate_series(100, 160) AS g"
        )
        app.execute(f"DELETE FROM {table} WHERE id BETWEEN 150 AND 155")
        app.commit()

    expected = table_state(pg, table, table)
    state, messages, tail = stream_state(client, path)
    sse.until(tail)

    # Catch-up: exactly the committed changes, snapshot first.
    assert messages[0] == {"headers": {"control": "snapshot-start"}}
    assert messages[4] == {"headers": {"control": "snapshot-end"}}
    changes = [m for m in messages if "operation" in m.get("headers", {})]
    assert [m["headers"]["operation"] for m in changes[3:]] == (
        ["insert", "update"]  # fig; apple's price
        + ["update"] * 3  # the three rows of one statement
        + ["delete", "insert", "delete"]  # 3 -> 30, then pear
        + ["insert"] * 61
        + ["delete"] * 6
    )
    assert all(m["key"] != rolled_back_key for m in changes)
    assert all(m.get("value", {}).get("name") != "never either" for m in changes)
    assert state == expected
    # One transaction's changes share a txid (STATE-PROTOCOL.md 5.1, headers.txid).
    assert changes[3]["headers"]["txid"] == changes[4]["headers"]["txid"]
    assert changes[4]["headers"]["txid"] != changes[5]["headers"]["txid"]

    # SSE from -1 delivered the same messages, in the same order.
    assert sse.result()[: len(messages)] == messages

    # The reference clients: catch-up (json()) and live SSE (subscribeJson).
    caught_up = run_node(MATERIALIZE, server.stream_url(path))
    assert caught_up["offset"] == tail
    assert entities_state(caught_up["entities"]) == expected
    followed = run_node(FOLLOW, server.stream_url(path), "-1", tail)
    assert any(r["live"] == "sse" for r in followed["requests"]), followed["requests"]
    assert entities_state(followed["entities"]) == expected
    assert followed["controls"] == {"snapshot-start": 1, "snapshot-end": 1}


def test_live_reference_client_sees_changes_as_they_commit(
    server: ServerProcess, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """The reference client follows the stream over SSE, up to date before the changes are
    made; each committed transaction reaches it live (the append inside the commit notifies
    the server), and once it sees the last row its state equals the table."""
    table = unique("live")
    path = f"tablesync/{table}"
    create_items_table(pg, table)
    command_ok(database_url, "publish_table", table, "--stream", path)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        start = http.head(f"/v1/stream/{path}").headers["Stream-Next-Offset"]
    node = shutil.which("node")
    assert node is not None
    follower = subprocess.Popen(
        [node, str(FOLLOW), server.stream_url(path), start, "key=999"],
        cwd=JS_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert follower.stderr is not None
        assert follower.stderr.readline().strip() == "ready"  # up to date, waiting live
        with psycopg.connect(database_url, autocommit=True) as app:
            for i in range(5):
                app.execute(f"INSERT INTO {table} (id, name) VALUES ({i}, 'n{i}')")
            app.execute(f"UPDATE {table} SET name = 'changed' WHERE id < 3")
            app.execute(f"DELETE FROM {table} WHERE id = 4")
            app.execute(f"INSERT INTO {table} (id, name) VALUES (999, 'last')")
        out, err = follower.communicate(timeout=90)
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["requests"] and all(r["live"] == "sse" for r in report["requests"][1:])
    assert entities_state(report["entities"]) == table_state(pg, table, table)


def test_concurrent_writers_publish_in_commit_order_exactly_once(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """8 writers update shared rows (each update increments the row's version under its row
    lock) and insert their own, some transactions rolled back, some spanning statements: per
    key the stream holds every committed version exactly once, in increasing order (commit
    order), no rolled-back version, and the final state equals the table."""
    table = unique("contended")
    path = f"tablesync/{table}"
    create_items_table(pg, table)
    pg.execute(f"INSERT INTO {table} (id, name) SELECT g, 'row' FROM generate_series(0, 9) AS g")
    command_ok(database_url, "publish_table", table, "--stream", path, "--snapshot")
    committed: dict[str, list[int]] = {str(k): [1] for k in range(10)}
    lock = threading.Lock()
    errors: list[Exception] = []

    def writer(worker: int) -> None:
        rng = random.Random(worker)
        try:
            with psycopg.connect(database_url) as app:
                for i in range(40):
                    keys = sorted(rng.sample(range(10), rng.randint(1, 3)))
                    rollback = rng.random() < 0.2
                    versions: dict[str, int] = {}
                    for key in keys:
                        row = app.execute(
                            f"UPDATE {table} SET version = version + 1 WHERE id = %s"
                            " RETURNING version",
                            [key],
                        ).fetchone()
                        assert row is not None
                        versions[str(key)] = row[0]
                    own = 1000 + worker * 100 + i
                    app.execute(f"INSERT INTO {table} (id, name) VALUES (%s, 'own')", [own])
                    if rollback:
                        app.rollback()
                        continue
                    app.commit()
                    with lock:
                        for key, version in versions.items():
                            committed[key].append(version)
                        committed[str(own)] = [1]
        except Exception as exc:  # noqa: BLE001 - reported after join()
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors

    state, messages, _ = stream_state(client, path)
    seen: dict[str, list[int]] = {}
    for message in messages:
        if "operation" in message["headers"]:
            seen.setdefault(message["key"], []).append(message["value"]["version"])
    assert {k: sorted(v) for k, v in committed.items()} == seen
    for key, versions in seen.items():
        assert versions == sorted(versions), f"key {key}: not in commit order: {versions}"
        assert len(set(versions)) == len(versions), f"key {key}: repeated: {versions}"
    assert state == table_state(pg, table, table)


def test_bulk_copy_and_update_arrive_whole_and_in_order(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """COPY of 60,000 rows and an UPDATE of all of them, each one statement (captured in
    pieces of 50,000 events), then a TRUNCATE (a reset event): the stream holds them all, in
    order, and materializes to the table."""
    table = unique("bulk")
    path = f"tablesync/{table}"
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, label text)")
    command_ok(database_url, "publish_table", table, "--stream", path)
    rows = 60_000
    with psycopg.connect(database_url) as app:
        with app.cursor().copy(f"COPY {table} (id, label) FROM STDIN") as copy:
            for i in range(rows):
                copy.write_row((i, f"copied {i}"))
        app.commit()
        app.execute(f"UPDATE {table} SET label = label || ' and updated'")
        app.commit()
    state, messages, _ = stream_state(client, path)
    assert len(messages) == 2 * rows
    assert [m["headers"]["operation"] for m in messages] == ["insert"] * rows + ["update"] * rows
    assert state == table_state(pg, table, table)

    pg.execute(f"TRUNCATE {table}")
    pg.execute(f"INSERT INTO {table} VALUES (1, 'after truncate')")
    state, messages, _ = stream_state(client, path)
    assert messages[2 * rows] == {"headers": {"control": "reset"}}
    assert (
        state
        == {(table, "1"): {"id": 1, "label": "after truncate"}}
        == table_state(pg, table, table)
    )


def test_published_columns_type_and_composite_key(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """--columns limits the value (and an update of other columns publishes nothing); --type
    names the entity type; a composite key is the JSON array of its values; a Django model
    can be named by its label."""
    table = unique("lines")
    path = f"tablesync/{table}"
    pg.execute(
        f"CREATE TABLE {table} (order_id int, line int, sku text, qty int, secret text,"
        " PRIMARY KEY (order_id, line))"
    )
    command_ok(
        database_url, "publish_table", table, "--stream", path, "--type", "line",
        "--columns", "sku,qty",
    )  # fmt: skip
    pg.execute(f"INSERT INTO {table} VALUES (7, 1, 'A', 2, 's1'), (7, 2, 'B', 1, 's2')")
    pg.execute(f"UPDATE {table} SET secret = 'changed'")
    pg.execute(f"UPDATE {table} SET qty = 5 WHERE line = 2")
    messages, _ = read_messages(client, path)
    assert [(m["type"], m["key"], m["headers"]["operation"], m["value"]) for m in messages] == [
        ("line", "[7, 1]", "insert", {"sku": "A", "qty": 2}),
        ("line", "[7, 2]", "insert", {"sku": "B", "qty": 1}),
        ("line", "[7, 2]", "update", {"sku": "B", "qty": 5}),
    ]

    # A Django model, by its label: resolved to its table (auth_group, one of the server's
    # own, so refused: the only models installed are the server's).
    refused = command_fails(database_url, "publish_table", "auth.Group", "--stream", "x/group")
    assert "auth_group is one of the server's own tables (auth)" in refused


def test_published_stream_is_read_only_for_clients_and_unpublish_stops_cleanly(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """Clients may read a published stream but not write it (403: only the table writes it).
    Unpublishing: changes committed before are in the stream, none after; --close-stream
    closes it (PROTOCOL.md 5.2 Stream-Closed); the stream is the clients' again."""
    table = unique("owned")
    path = f"tablesync/{table}"
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    command_ok(database_url, "publish_table", table, "--stream", path)
    url = f"/v1/stream/{path}"
    body = json.dumps([{"headers": {"control": "reset"}}])
    json_type = {"Content-Type": "application/json"}

    def refused() -> bool:
        return client.post(url, headers=json_type, content=body).status_code == 403

    wait_until(refused, "the published stream refuses client appends")
    assert client.delete(url).status_code == 403
    assert client.put(url, headers=json_type).status_code == 403
    assert client.get(url, params={"offset": "-1"}).status_code == 200

    pg.execute(f"INSERT INTO {table} VALUES (1, 'before')")
    command_ok(database_url, "unpublish_table", table, "--close-stream")
    pg.execute(f"INSERT INTO {table} VALUES (2, 'after')")
    messages, _ = read_messages(client, path)
    assert [m["key"] for m in messages] == ["1"]
    head = client.head(url)
    assert head.headers.get("Stream-Closed") == "true"
    wait_until(lambda: client.delete(url).status_code == 204, "the stream is writable again")


def test_a_committed_change_never_goes_missing(
    pg: psycopg.Connection[Any], database_url: str
) -> None:
    """When the stream cannot take a change (here it was deleted behind the server's back),
    the table's transaction fails with a clear error instead of committing a change its stream
    would miss."""
    table = unique("orphan")
    path = f"tablesync/{table}"
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    command_ok(database_url, "publish_table", table, "--stream", path)
    pg.execute("SELECT ds_delete(%s)", [path])
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as refused:
        pg.execute(f"INSERT INTO {table} VALUES (1)")
    assert "refused its changes" in str(refused.value)
    assert pg.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)
    command_ok(database_url, "unpublish_table", table)
    pg.execute(f"INSERT INTO {table} VALUES (1)")  # unpublished: writable again


def test_publish_refuses_what_it_cannot_publish(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """Operator mistakes get a clear error and change nothing: no table, a name that is not
    SQL, a table without a primary key, unknown columns, the server's own tables, a stream
    that is not JSON, a reserved path, a table published twice."""
    table = unique("plain")
    keyless = unique("keyless")
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg.execute(f"CREATE TABLE {keyless} (v text)")
    text_path = f"tablesync/{unique('text')}"
    assert client.put(f"/v1/stream/{text_path}", headers={"Content-Type": "text/plain"}).is_success
    cases = [
        (("no_such_table", "--stream", "x/1"), "not found"),
        (('"unterminated', "--stream", "x/2"), "not a valid table name"),
        ((keyless, "--stream", "x/3"), "no primary key"),
        ((table, "--stream", "x/4", "--columns", "v,nope"), "no column"),
        (("ds_message", "--stream", "x/5"), "own tables"),
        # A session key read from the stream signs its reader in (review of probe 10h).
        (("django_session", "--stream", "x/6"), "own tables (sessions)"),
        (("auth.User", "--stream", "x/7"), "own tables (auth)"),
        # The admin's log, API keys' hashes, Yjs documents, Django's migrations: the server's.
        (("django_admin_log", "--stream", "x/8"), "own tables (admin)"),
        (("rest_framework_api_key_apikey", "--stream", "x/9"), "own tables"),
        (("yjs_document", "--stream", "x/10"), "own tables (yjs)"),
        (("django_migrations", "--stream", "x/11"), "own tables"),
        (("auth_group", "--stream", "x/12"), "own tables (auth)"),
        ((table, "--stream", text_path), "not application/json"),
        ((table, "--stream", "__registry__"), "written by the server"),
        ((table, "--stream", "__ds/x"), "reserved"),
        ((table, "--stream", "a/../b"), "segment"),
    ]
    for args, message in cases:
        assert message in command_fails(database_url, "publish_table", *args), args
    for i in range(1, 13):
        assert client.head(f"/v1/stream/x/{i}").status_code == 404
    assert pg.execute(
        "SELECT count(*) FROM pg_trigger"
        " WHERE tgname LIKE 'ds_tablesync_%%' AND tgrelid = %s::regclass",
        [table],
    ).fetchone() == (0,)
    command_ok(database_url, "publish_table", table, "--stream", f"tablesync/{table}")
    assert "already published" in command_fails(
        database_url, "publish_table", table, "--stream", f"tablesync/{table}-again"
    )
    assert "not published" in command_fails(database_url, "unpublish_table", keyless)


def test_publish_and_unpublish_in_the_admin(
    client: httpx.Client, admin_client: httpx.Client, pg: psycopg.Connection[Any]
) -> None:
    """The admin's add form publishes (with a snapshot), a refusal is shown on the form and
    publishes nothing, and deleting the publication unpublishes the table."""
    table = unique("admin_pub")
    path = f"tablesync/{table}"
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg.execute(f"INSERT INTO {table} VALUES (1, 'one')")
    add_url = "/admin/tablesync/tablepublication/add/"
    form = {"table": table, "stream_path": path, "entity_type_name": "thing",
            "column_list": "", "snapshot": "on"}  # fmt: skip
    refused = admin_client.post(
        add_url, data={**form, "table": f"{table}_missing", "csrfmiddlewaretoken":
                       csrf(admin_client, add_url)},
    )  # fmt: skip
    assert refused.status_code == 200 and "not found" in refused.text
    assert client.head(f"/v1/stream/{path}").status_code == 404
    added = admin_client.post(
        add_url, data={**form, "csrfmiddlewaretoken": csrf(admin_client, add_url)}
    )
    assert added.status_code == 200 and "was added successfully" in added.text, added.text[-2000:]
    pg.execute(f"UPDATE {table} SET v = 'uno'")
    messages, _ = read_messages(client, path)
    assert [(m.get("type"), m["headers"].get("operation")) for m in messages] == [
        (None, None), ("thing", "insert"), (None, None), ("thing", "update"),
    ]  # fmt: skip
    (publication_id,) = pg.execute(
        "SELECT id FROM ds_table_publication WHERE table_name = %s", [table]
    ).fetchone() or (None,)
    delete_url = f"/admin/tablesync/tablepublication/{publication_id}/delete/"
    deleted = admin_client.post(
        delete_url, data={"post": "yes", "csrfmiddlewaretoken": csrf(admin_client, delete_url)}
    )
    assert deleted.status_code == 200, deleted.text[-2000:]
    pg.execute(f"DELETE FROM {table}")
    assert len(read_messages(client, path)[0]) == 4


def test_a_table_writer_gains_no_rights_through_the_publication(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """The publication trigger turns rows into JSON with the server's rights (SECURITY
    DEFINER), and to_json turns a value of a type not built in through a cast to json, which
    the type's owner may write: a role that owns a published table (no other rights) added a
    column of its own enum type with such a cast, and its function ran as the server's role
    (found by an adversarial probe; here it records current_user). Now the write that would run
    it fails, and a table with such a column is refused at publish; types owned by the
    server's role, and domains over built-in types, are published as before. A role that may
    create objects in the server's schema could stand in for a built-in function there (a
    to_json(record) of its own, found by review): publishing is refused while one may, and so
    are writes to tables already published."""
    role, table, owned = unique("ts_writer"), unique("writer_rows"), unique("writer_owned")
    pg.execute(f"CREATE ROLE {role} NOLOGIN")
    try:
        pg.execute(f"CREATE SCHEMA {role} AUTHORIZATION {role}")  # where it may create things
        pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, note text)")
        pg.execute(f"ALTER TABLE {table} OWNER TO {role}")
        command_ok(database_url, "publish_table", table, "--stream", f"tablesync/{table}")
        with psycopg.connect(database_url, autocommit=True) as writer:
            writer.execute(f"SET ROLE {role}")
            writer.execute(f"SET search_path = {role}, public")
            writer.execute("CREATE TABLE seen (who text)")
            writer.execute("CREATE TYPE mood AS ENUM ('happy')")
            writer.execute(
                "CREATE FUNCTION mood_json(mood) RETURNS json LANGUAGE plpgsql AS"
                " $$ BEGIN INSERT INTO seen VALUES (current_user); RETURN to_json($1::text); END $$"
            )
            writer.execute("CREATE CAST (mood AS json) WITH FUNCTION mood_json(mood)")
            writer.execute(f"ALTER TABLE public.{table} ADD COLUMN mood mood")
            with pytest.raises(psycopg.errors.RaiseException, match="cannot publish"):
                writer.execute(f"INSERT INTO public.{table} VALUES (1, 'x', 'happy')")
            assert writer.execute("SELECT who FROM seen").fetchall() == []
            writer.execute("INSERT INTO seen VALUES (current_user)")
            assert writer.execute("SELECT who FROM seen").fetchall() == [(role,)]
            writer.execute(f"ALTER TABLE public.{table} DROP COLUMN mood")
            writer.execute(f"INSERT INTO public.{table} VALUES (1, 'x')")  # published again
            pg.execute(f"GRANT CREATE ON SCHEMA public TO {role}")
            with pytest.raises(psycopg.errors.RaiseException, match="may create objects"):
                writer.execute(f"INSERT INTO public.{table} VALUES (2, 'y')")
        pg.execute(f"CREATE TABLE {table}_other (id int PRIMARY KEY)")
        assert "may create objects" in command_fails(
            database_url, "publish_table", f"{table}_other", "--stream", f"tablesync/{table}-o"
        )
        pg.execute(f"REVOKE CREATE ON SCHEMA public FROM {role}")
        command_ok(database_url, "unpublish_table", table)
        with psycopg.connect(database_url, autocommit=True) as writer:
            writer.execute(f"SET ROLE {role}")
            writer.execute(f"ALTER TABLE public.{table} ADD COLUMN mood {role}.mood")
        assert "cannot publish" in command_fails(
            database_url, "publish_table", table, "--stream", f"tablesync/{table}-again"
        )

        # The server's own enum type, a domain over a built-in type: published as before.
        path = f"tablesync/{owned}"
        pg.execute(f"CREATE TYPE {owned}_size AS ENUM ('s', 'm')")
        pg.execute(f"CREATE DOMAIN {owned}_qty AS int CHECK (VALUE >= 0)")
        pg.execute(
            f"CREATE TABLE {owned} (id int PRIMARY KEY, size {owned}_size, qty {owned}_qty,"
            f" sizes {owned}_size[])"
        )
        command_ok(database_url, "publish_table", owned, "--stream", path)
        pg.execute(f"INSERT INTO {owned} VALUES (1, 'm', 3, ARRAY['s','m']::{owned}_size[])")
        messages, _ = read_messages(client, path)
        assert [m["value"] for m in messages] == [
            {"id": 1, "size": "m", "qty": 3, "sizes": ["s", "m"]}
        ]
        command_ok(database_url, "unpublish_table", owned)
    finally:
        pg.execute(f"DROP TABLE IF EXISTS {table}_other")
        pg.execute(f"REVOKE ALL ON SCHEMA public FROM {role}")
        pg.execute(f"DROP OWNED BY {role} CASCADE")
        pg.execute(f"DROP ROLE {role}")


def test_a_column_named_like_the_row_publishes_the_row(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """The trigger and the snapshot turn each row into JSON under an alias: a column of the
    same name won, so a text column made every write fail ("has no key") and a jsonb one
    published its own contents, keyed by them (found by an adversarial probe)."""
    table = unique("aliased")
    path = f"tablesync/{table}"
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, owner text, t jsonb, j text)")
    pg.execute(f"INSERT INTO {table} VALUES (7, 'carol', '{{\"id\": 8}}', 'x')")
    command_ok(database_url, "publish_table", table, "--stream", path, "--snapshot")
    pg.execute(
        f"""INSERT INTO {table} VALUES (1, 'alice', '{{"id": 42, "owner": "mallory"}}', 'y')"""
    )
    pg.execute(f"UPDATE {table} SET owner = 'bob' WHERE id = 1")
    messages, _ = read_messages(client, path)
    changes = [(m["key"], m["headers"]["operation"], m["value"]) for m in messages if "key" in m]
    assert changes == [
        ("7", "insert", {"id": 7, "owner": "carol", "t": {"id": 8}, "j": "x"}),
        ("1", "insert", {"id": 1, "owner": "alice", "t": {"id": 42, "owner": "mallory"}, "j": "y"}),
        ("1", "update", {"id": 1, "owner": "bob", "t": {"id": 42, "owner": "mallory"}, "j": "y"}),
    ]
    command_ok(database_url, "unpublish_table", table)


def test_partitioned_tables_and_partitions_are_refused(
    pg: psycopg.Connection[Any], database_url: str
) -> None:
    """A statement's triggers are those of the table it names: a partitioned table's would miss
    writes to its partitions, a partition's writes through the parent (found by an adversarial
    probe). Both are refused at publish."""
    table = unique("parted")
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY) PARTITION BY RANGE (id)")
    pg.execute(f"CREATE TABLE {table}_1 PARTITION OF {table} FOR VALUES FROM (0) TO (100)")
    for name in (table, f"{table}_1"):
        error = command_fails(database_url, "publish_table", name, "--stream", f"tablesync/{name}")
        assert "partition" in error, error


def test_tables_whose_changes_cannot_be_captured_right_are_refused(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """Found by a probe: a deferrable primary key let a transaction hold a key in two rows, and
    the events keyed by it cancelled out (the stream lost rows the table held); a published
    table made an inheritance child (or parent) had writes through the other table unseen; a
    published column renamed was published as null. Such a table is refused at publish, and
    once published, a statement on it after such a change fails (nothing appended) instead."""
    deferred = unique("deferred")
    pg.execute(f"CREATE TABLE {deferred} (id int PRIMARY KEY DEFERRABLE, v text)")
    error = command_fails(database_url, "publish_table", deferred, "--stream", f"t/{deferred}")
    assert "deferrable" in error, error
    parent, child = unique("parent"), unique("child")
    pg.execute(f"CREATE TABLE {parent} (id int PRIMARY KEY, v text)")
    pg.execute(f"CREATE TABLE {child} (id int PRIMARY KEY, v text) INHERITS ({parent})")
    for name in (parent, child):
        error = command_fails(database_url, "publish_table", name, "--stream", f"t/{name}")
        assert "inherit" in error, error

    changes = [
        ("deferrable", "ALTER TABLE {t} DROP CONSTRAINT {t}_pkey,"
                       " ADD PRIMARY KEY (id) DEFERRABLE INITIALLY DEFERRED"),
        ("inherit", f"ALTER TABLE {{t}} INHERIT {parent}"),
        ("gone", "ALTER TABLE {t} RENAME COLUMN v TO w"),
    ]  # fmt: skip
    for word, ddl in changes:
        table = unique("published")
        path = f"tablesync/{table}"
        pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        command_ok(database_url, "publish_table", table, "--stream", path, "--columns", "id,v")
        pg.execute(f"INSERT INTO {table} VALUES (1, 'a')")
        pg.execute(ddl.format(t=table))
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as raised:
            pg.execute(f"INSERT INTO {table} VALUES (2, 'b')")
        assert word in str(raised.value), raised.value
        messages, _ = read_messages(client, path)
        assert [m["key"] for m in messages if "key" in m] == ["1"], (word, messages)
        command_ok(database_url, "unpublish_table", table)


def test_a_published_stream_keeps_its_history(
    client: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """A reader from -1 needs the snapshot and every change after it: a stream with a retention
    policy was accepted, and a trim left a probe's stream materializing 1 row of 5. A stream
    with a policy of its own is refused at publish; a client's trim of a published stream is
    refused (409); the server-wide default policy does not apply to it (docs/gaps.md)."""
    table = unique("kept")
    path = f"tablesync/{table}"
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    policy = {"Content-Type": "application/json", "Stream-Retention-Max-Bytes": "200"}
    assert client.put(f"/v1/stream/{path}-own", headers=policy).status_code == 201
    error = command_fails(database_url, "publish_table", table, "--stream", f"{path}-own")
    assert "retention" in error, error
    command_ok(database_url, "publish_table", table, "--stream", path)
    pg.execute(f"INSERT INTO {table} VALUES (1, 'a'), (2, 'b')")
    tail = client.head(f"/v1/stream/{path}").headers["Stream-Next-Offset"]
    refused = client.post(f"/v1/stream/{path}", headers={"Stream-Trim-Before": tail})
    assert refused.status_code in (403, 409), refused.text
    keeps = pg.execute(
        "SELECT ds_hook_keeps_history(s.id) FROM ds_stream AS s WHERE s.path = %s", [path]
    ).fetchone()
    assert keeps == (True,)
    messages, _ = read_messages(client, path)
    assert [m["key"] for m in messages] == ["1", "2"]
    command_ok(database_url, "unpublish_table", table)
