"""Compaction of registered state streams, through real HTTP and the real commands
(STATE-PROTOCOL.md 6: materialization; PROTOCOL.md 5.6: 410 before the earliest retained
position; docs/gaps.md, Retention).

Histories are random but seeded: inserts, updates and deletes over a few hundred keys, a
reset, snapshot markers. Each event is its own append, so the offset where each one starts is
known; after compaction every kept event is found at its original offset, and a reader
resuming from ANY original offset (kept, compacted away, or in a run of compacted events)
reaches exactly the final state."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, manage
from tests.retention.support import eventually
from tests.state.support import (
    JSON,
    REGISTRY,
    STATE,
    change,
    control,
    entities,
    entity_map,
    model,
    read_messages,
    register,
    registration,
    stream_url,
)

TYPES = ["user", "flag", "config"]


def history(rng: random.Random, count: int, *, keys: int = 60) -> list[dict[str, Any]]:
    """Random changes over ``keys`` keys of each type: mostly updates, some deletes, snapshot
    markers now and then."""
    events: list[dict[str, Any]] = []
    for i in range(count):
        roll = rng.random()
        entity_type = rng.choice(TYPES)
        key = f"{entity_type}-{rng.randrange(keys)}"
        if roll < 0.02:
            events.append(control(rng.choice(["snapshot-start", "snapshot-end"])))
        elif roll < 0.15:
            events.append(change(entity_type, key, op="delete"))
        else:
            op = "insert" if roll < 0.4 else "update"
            events.append(change(entity_type, key, {"n": i, "tag": rng.choice("abc")}, op))
    return events


def write(client: httpx.Client, path: str, events: list[dict[str, Any]]) -> list[str]:
    """Append each event on its own: the offset where each starts, then the tail."""
    offsets = [client.head(stream_url(path)).headers["Stream-Next-Offset"]]
    for event in events:
        response = client.post(stream_url(path), headers=JSON, content=json.dumps([event]))
        assert response.status_code in (200, 204), response.text
        offsets.append(response.headers["Stream-Next-Offset"])
    return offsets


def start_of(client: httpx.Client, path: str) -> str:
    return client.head(stream_url(path)).headers["Stream-Start-Offset"]


def create_registered(
    client: httpx.Client, path: str, *, tombstone_seconds: int = 86400
) -> dict[str, Any]:
    assert client.put(stream_url(path), headers=JSON).status_code == 201
    response = register(client, path)
    assert response.status_code == 201, response.text
    payload = {"stream": path, "compaction": True, "tombstone_seconds": tombstone_seconds}
    # The same registration with compaction differs: 409; the compacted one is made anew.
    conflict = client.post(f"{STATE}/streams", json=payload)
    assert conflict.status_code == 409
    assert client.delete(f"{STATE}/streams/{path}").status_code == 204
    made = client.post(f"{STATE}/streams", json=payload)
    assert made.status_code == 201, made.text
    assert made.json()["compaction"] is True
    assert made.json()["tombstone_seconds"] == tombstone_seconds
    return made.json()


def compact(database_url: str, path: str) -> str:
    result = manage(database_url, "compact_state", "--stream", path)
    assert result.returncode == 0, result.stderr
    return result.stdout


def stored(pg: Any, path: str) -> tuple[int, int]:
    """Rows and bytes of the stream's messages in the database."""
    row = pg.execute(
        "SELECT count(*), coalesce(sum(octet_length(m.data)), 0) FROM ds_message AS m"
        " JOIN ds_stream AS s ON s.id = m.stream_id WHERE s.path = %s",
        [path],
    ).fetchone()
    return row[0], row[1]


def state_of(events: list[Any]) -> dict[tuple[str, str], Any]:
    return model(events)


@pytest.fixture
def compacted(
    client: httpx.Client, stream_path: str, database_url: str, pg: Any
) -> Iterator[dict[str, Any]]:
    """A state stream with a history of updates, deletes and a reset, compacted once."""
    rng = random.Random(20261123)
    create_registered(client, stream_path)
    events = [*history(rng, 120), control("reset"), *history(rng, 280)]
    offsets = write(client, stream_path, events)
    before_messages, tail = read_messages(client, stream_path)
    assert before_messages == events and tail == offsets[-1]
    before_entities = entities(client, stream_path)
    rows_before = stored(pg, stream_path)
    output = compact(database_url, stream_path)
    yield {
        "path": stream_path,
        "events": events,
        "offsets": offsets,
        "entities": before_entities,
        "rows_before": rows_before,
        "output": output,
    }


def test_compaction_keeps_exactly_the_current_state(
    client: httpx.Client, compacted: dict[str, Any], pg: Any
) -> None:
    """STATE-PROTOCOL.md 6: read from -1, the compacted stream materializes to the state the
    full history did; /v1/state/entities is unchanged (values and offsets); what remains is one
    event per key after the reset (plus the reset), and fewer rows and bytes."""
    path, events = compacted["path"], compacted["events"]
    final = state_of(events)
    messages, tail = read_messages(client, path)
    assert tail == compacted["offsets"][-1]
    assert state_of(messages) == final
    assert entities(client, path) == compacted["entities"]
    assert entity_map(client, path) == final
    # The reset, then the latest event of each key changed after it (deletes within the
    # tombstone period included).
    reset_at = events.index(control("reset"))
    touched = {(e["type"], e["key"]) for e in events[reset_at:] if "type" in e}
    assert messages[0] == control("reset")
    assert len(messages) == 1 + len(touched) and len(touched) > len(final)
    rows, size = stored(pg, path)
    assert (rows, size) < compacted["rows_before"] and rows == len(messages)
    assert f"-> {len(messages)} kept" in compacted["output"]


def test_kept_events_keep_their_offsets(client: httpx.Client, compacted: dict[str, Any]) -> None:
    """PROTOCOL.md 8: offsets persist. Each entity's event (its offset, from the state API) is
    read first from that offset, as is the reset from the offset it was appended at."""
    path, events, offsets = compacted["path"], compacted["events"], compacted["offsets"]
    for entity in compacted["entities"]:
        response = client.get(stream_url(path), params={"offset": entity["offset"]})
        assert response.status_code == 200
        first = response.json()[0]
        assert (first["type"], first["key"], first["value"]) == (
            entity["type"],
            entity["key"],
            entity["value"],
        )
    reset_at = events.index(control("reset"))
    response = client.get(stream_url(path), params={"offset": offsets[reset_at]})
    assert response.json()[0] == control("reset")


def test_readers_resume_from_any_offset(client: httpx.Client, compacted: dict[str, Any]) -> None:
    """A reader that materialized the full history up to any offset, compacted away or not,
    resumes there without error and reaches exactly the final state: its read continues at
    the next kept event. The same in long-poll and SSE."""
    path, events, offsets = compacted["path"], compacted["events"], compacted["offsets"]
    final = state_of(events)
    for i in range(0, len(events) + 1, 7):
        rest, tail = read_messages(client, path, offsets[i])
        assert tail == offsets[-1]
        assert state_of([*events[:i], *rest]) == final, i
    kept = read_messages(client, path)[0]
    # An event in the middle that compaction dropped.
    i = next(i for i in range(len(events) // 2, len(events)) if events[i] not in kept)
    polled = client.get(stream_url(path), params={"offset": offsets[i], "live": "long-poll"})
    assert polled.status_code == 200 and polled.headers["Stream-Up-To-Date"] == "true"
    assert state_of([*events[:i], *polled.json()]) == final
    params = {"offset": offsets[i], "live": "sse"}
    received: list[Any] = []
    with client.stream("GET", stream_url(path), params=params) as response:
        assert response.status_code == 200
        kind = None
        for line in response.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:") and kind == "data":
                received.append(line[5:])
            elif kind == "control" and line.startswith("data:") and '"upToDate":true' in line:
                break
    data = json.loads("".join(received)) if received else []
    assert state_of([*events[:i], *data]) == final


def test_appends_and_a_second_compaction(
    client: httpx.Client, compacted: dict[str, Any], database_url: str
) -> None:
    """The stream goes on after compaction; a second one keeps the state exact again."""
    path, events = compacted["path"], compacted["events"]
    more = history(random.Random(7), 200)
    offsets = write(client, path, more)
    everything = [*events, *more]
    assert state_of(read_messages(client, path)[0]) == state_of(everything)
    output = compact(database_url, path)
    assert "deleted" in output
    messages, tail = read_messages(client, path)
    assert tail == offsets[-1]
    assert state_of(messages) == state_of(everything) == entity_map(client, path)


def test_rebuilding_from_the_compacted_stream_gives_the_same_state(
    client: httpx.Client, compacted: dict[str, Any], database_url: str
) -> None:
    """``materialize_state --rebuild`` recomputes the state from what the stream holds now."""
    path = compacted["path"]
    result = manage(database_url, "materialize_state", "--stream", path, "--rebuild")
    assert result.returncode == 0, result.stderr
    assert entities(client, path) == compacted["entities"]


def test_forks_and_compaction(client: httpx.Client, compacted: dict[str, Any]) -> None:
    """A fork inside compacted history is refused (410: that history is not retained as it
    was); a fork at the tail inherits the compacted history and materializes the same state."""
    path, events, offsets = compacted["path"], compacted["events"], compacted["offsets"]
    inside = {"Stream-Forked-From": stream_url(path), "Stream-Fork-Offset": offsets[100]}
    refused = client.put(stream_url(f"{path}-inside"), headers=inside)
    assert refused.status_code == 410
    assert refused.headers["Stream-Start-Offset"] == start_of(client, path)
    at_tail = client.put(
        stream_url(f"{path}-fork"), headers={"Stream-Forked-From": stream_url(path)}
    )
    assert at_tail.status_code == 201
    assert state_of(read_messages(client, f"{path}-fork")[0]) == state_of(events)


def test_deletes_older_than_the_tombstone_period_go(
    client: httpx.Client, stream_path: str, database_url: str
) -> None:
    """With a tombstone period of 0 every delete is dropped: -1 still materializes the state,
    but a reader resuming between the start and a dropped delete would miss it, so those
    offsets are gone (410, saying where the stream starts); after the last dropped delete,
    resuming works."""
    create_registered(client, stream_path, tombstone_seconds=0)
    events = [
        change("user", "a", {"v": 1}),
        change("user", "b", {"v": 1}),
        change("user", "a", op="delete"),
        change("user", "c", {"v": 1}),
        change("user", "b", {"v": 2}, "update"),
    ]
    offsets = write(client, stream_path, events)
    assert "old deletes dropped" in compact(database_url, stream_path)
    messages = read_messages(client, stream_path)[0]
    assert messages == [events[3], events[4]]
    assert state_of(messages) == state_of(events) == entity_map(client, stream_path)
    for i in (1, 2):
        gone = client.get(stream_url(stream_path), params={"offset": offsets[i]})
        assert gone.status_code == 410
        assert gone.headers["Stream-Start-Offset"] == offsets[0]
        assert "a compaction dropped" in gone.text
    # The start itself (nothing read yet, nothing to miss) and what follows the delete work.
    for i in (0, 3, 4):
        rest = read_messages(client, stream_path, offsets[i])[0]
        assert state_of([*events[:i], *rest]) == state_of(events)


@pytest.fixture(scope="module")
def compacting(start_server: Any) -> Iterator[ServerProcess]:
    """A server that compacts state streams with 50 new events, often."""
    server = start_server(
        env={"DS_STATE__COMPACTION_INTERVAL_SECS": "0.3", "DS_STATE__COMPACTION_MIN_EVENTS": "50"}
    )
    yield server
    server.stop()


def test_the_server_compacts_in_the_background_while_readers_follow(
    compacting: ServerProcess, stream_path: str
) -> None:
    """The compaction sweep compacts a stream registered with compaction once it has enough
    new events; a live SSE reader that follows it from -1 all along ends with the same state
    as one that reads it from -1 afterwards."""
    rng = random.Random(99)
    with httpx.Client(base_url=compacting.base_url, timeout=30) as client:
        create_registered(client, stream_path)
        events = history(rng, 300, keys=10)
        write(client, stream_path, events)
        done = eventually(
            lambda: registration(client, stream_path).json()["compacted_at"], what="compaction"
        )
        assert done is not None
        assert registration(client, stream_path).json()["compacted_events"] > 0
        messages = read_messages(client, stream_path)[0]
        assert len(messages) < len(events)
        assert state_of(messages) == state_of(events) == entity_map(client, stream_path)
        # More appends, while the sweep runs, read live from the compacted start.
        more = history(rng, 120, keys=10)
        write(client, stream_path, more)
        assert state_of(read_messages(client, stream_path)[0]) == state_of([*events, *more])


def test_the_registry_compacts(compacting: ServerProcess, stream_path: str) -> None:
    """Probe 9a: ``__registry__`` kept every create and delete ever made (3,000 create-delete
    cycles left 6,000 events for a catalog of no streams, all read by anyone following it from
    -1). It compacts like any compacted state stream now: a stream created and deleted leaves
    its delete (for the tombstone period), one still there its insert."""
    text = {"Content-Type": "text/plain"}
    with httpx.Client(base_url=compacting.base_url, timeout=30) as client:
        assert registration(client, REGISTRY).json()["compaction"] is True

        def churn(name: str) -> None:
            assert client.put(stream_url(name), headers=text).status_code == 201
            assert client.delete(stream_url(name)).status_code == 204

        for i in range(60):
            churn(f"{stream_path}/gone-{i}")
        assert client.put(stream_url(f"{stream_path}/kept"), headers=text).status_code == 201
        expected = sorted([(f"gone-{i}", "delete") for i in range(60)] + [("kept", "insert")])

        def compacted() -> bool | None:
            mine = [
                (event["key"].removeprefix(f"{stream_path}/"), event["headers"]["operation"])
                for event in read_messages(client, REGISTRY)[0]
                if event.get("key", "").startswith(f"{stream_path}/")
            ]
            if sorted(mine) == expected:
                return True
            churn(f"{stream_path}-filler/{len(mine)}-{time.monotonic_ns()}")  # the sweep's due
            return None

        eventually(compacted, what="the registry's compaction")
        kept = entities(client, REGISTRY, type="stream", key=f"{stream_path}/kept")
        assert [e["value"]["path"] for e in kept] == [f"{stream_path}/kept"]


@pytest.fixture(scope="module")
def small_pages(start_server: Any) -> Iterator[ServerProcess]:
    """A server whose reads carry at most 7 messages: compacted history of a few dozen events
    then spans several pages."""
    server = start_server(env={"DS_READ__MAX_CHUNK_MESSAGES": "7"})
    yield server
    server.stop()


def test_a_reader_from_the_start_gets_past_a_dropped_delete_on_any_page(
    small_pages: ServerProcess, stream_path: str, database_url: str
) -> None:
    """A delete dropped after 30 kept events, read 7 messages at a time: a read from -1 goes
    on past the dropped delete, so the offset it hands out is one a reader may resume from,
    and reading on to the tail (catch-up, and an SSE session) gives exactly the state. Before,
    the first page's next offset was below the dropped delete and answered 410, whose start
    offset sent the reader back to the start, for ever (found by a probe)."""
    with httpx.Client(base_url=small_pages.base_url, timeout=30) as client:
        create_registered(client, stream_path, tombstone_seconds=0)
        events = [change("user", f"k{i}", {"v": i}) for i in range(30)]
        events += [
            change("user", "x", {"v": 1}),
            change("user", "x", op="delete"),
            change("user", "y", {"v": 1}),
        ]
        write(client, stream_path, events)
        assert "old deletes dropped" in compact(database_url, stream_path)
        first = client.get(stream_url(stream_path), params={"offset": "-1"})
        assert first.status_code == 200
        messages, _ = read_messages(client, stream_path, first.headers["Stream-Next-Offset"])
        messages = [*first.json(), *messages]
        assert messages == [*events[:30], events[32]]
        assert state_of(messages) == state_of(events) == entity_map(client, stream_path)
        seen: list[Any] = []
        with client.stream(
            "GET", stream_url(stream_path), params={"offset": "-1", "live": "sse"}
        ) as sse:
            event, data = "", []
            for line in sse.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif not line:
                    if event == "data":
                        seen.extend(json.loads("\n".join(data)))
                    if event == "control" and json.loads("\n".join(data)).get("upToDate"):
                        break
                    event, data = "", []
        assert seen == messages


def test_events_the_materializer_skipped_do_not_decide_what_compaction_keeps(
    client: httpx.Client, stream_path: str, database_url: str
) -> None:
    """History stored before a registration may hold events the materializer skips: an
    unknown operation, a key that is not a string (whose text is a real key), a value its
    schema refuses. Compaction kept the latest message of each (type, key), and here those
    were the skipped ones: it deleted the three valid events, so a reader from -1, and a
    rebuild, lost every entity the state API still showed (found by a probe)."""
    assert client.put(stream_url(stream_path), headers=JSON).status_code == 201
    kept = [
        change("t", "a", {"v": "good-a"}),
        change("t", "7", {"v": "good-7"}),
        change("u", "s", {"n": 1}),
    ]
    skipped = [
        {"type": "t", "key": "a", "value": {"v": "x"}, "headers": {"operation": "bogus"}},
        {"type": "t", "key": 7, "value": {"v": "y"}, "headers": {"operation": "insert"}},
        change("u", "s", {"n": "not a number"}, "update"),
    ]
    history = [event for pair in zip(kept, skipped, strict=True) for event in pair]
    appended = client.post(stream_url(stream_path), headers=JSON, content=json.dumps(history))
    assert appended.status_code in (200, 204), appended.text
    payload = {
        "stream": stream_path,
        "compaction": True,
        "tombstone_seconds": 0,
        "schemas": {"u": {"type": "object", "properties": {"n": {"type": "number"}}}},
    }
    made = client.post(f"{STATE}/streams", json=payload)
    assert made.status_code == 201, made.text
    assert made.json()["invalid_events"] == 3
    state = {("t", "a"): {"v": "good-a"}, ("t", "7"): {"v": "good-7"}, ("u", "s"): {"n": 1}}
    assert entity_map(client, stream_path) == state
    compact(database_url, stream_path)
    assert read_messages(client, stream_path)[0] == kept
    result = manage(database_url, "materialize_state", "--stream", stream_path, "--rebuild")
    assert result.returncode == 0, result.stderr
    assert entity_map(client, stream_path) == state


def test_a_message_postgresql_cannot_read_stops_no_compaction(
    compacting: ServerProcess, stream_path: str, database_url: str
) -> None:
    """A ``\\u0000`` escape (or an unpaired surrogate) stored before registration: PostgreSQL
    cannot read it as jsonb. The plan failed on it, every sweep, and the sweep stopped at that
    stream, so every state stream after it went uncompacted for good; ``compact_state`` ended
    with a traceback (found by a probe). The message is kept as it is, both streams are
    compacted, and the command reports success."""
    rng = random.Random(5)
    poisoned, victim = f"{stream_path}/poisoned", f"{stream_path}/victim"
    with httpx.Client(base_url=compacting.base_url, timeout=30) as client:
        assert client.put(stream_url(poisoned), headers=JSON).status_code == 201
        unreadable = '[{"type":"t","key":"a\\u0000b","value":1,"headers":{"operation":"insert"}}]'
        answer = client.post(stream_url(poisoned), headers=JSON, content=unreadable)
        assert answer.status_code in (200, 204), answer.text
        payload = {"stream": poisoned, "compaction": True}
        assert client.post(f"{STATE}/streams", json=payload).status_code == 201
        create_registered(client, victim)
        for path in (poisoned, victim):
            write_all(client, path, history(rng, 120, keys=5))
        for path in (victim, poisoned):
            eventually(
                lambda path=path: registration(client, path).json()["compacted_at"],
                what=f"compaction of {path}",
            )
        messages = client.get(stream_url(poisoned), params={"offset": "-1"}).content
        assert b"a\\u0000b" in messages
    assert manage(database_url, "compact_state", "--stream", poisoned).returncode == 0


def write_all(client: httpx.Client, path: str, events: list[dict[str, Any]]) -> None:
    response = client.post(stream_url(path), headers=JSON, content=json.dumps(events))
    assert response.status_code in (200, 204), response.text


def test_a_deleted_key_keeps_its_latest_valid_delete(
    client: httpx.Client, stream_path: str, database_url: str
) -> None:
    """Within the tombstone period a deleted key keeps a delete for readers resuming before
    it: the latest one the materializer applies, not a later one it skips (a txid that is not
    a string, a control header beside the operation, a day that does not exist: found by
    review). The one with ``control: reset`` beside
    its operation was taken for a reset, and everything before it dropped."""
    assert client.put(stream_url(stream_path), headers=JSON).status_code == 201
    valid_delete = change("t", "k", op="delete")
    history = [
        change("t", "k", {"v": 1}),
        valid_delete,
        change("t", "k", op="delete", txid=5),
        change("t", "k", op="delete", control="reset"),
        change("t", "k", op="delete", timestamp="2026-02-30T00:00:00Z"),
        change("t", "other", {"v": 2}),
    ]
    appended = client.post(stream_url(stream_path), headers=JSON, content=json.dumps(history))
    assert appended.status_code in (200, 204), appended.text
    payload = {"stream": stream_path, "compaction": True, "tombstone_seconds": 86400}
    made = client.post(f"{STATE}/streams", json=payload)
    assert made.status_code == 201 and made.json()["invalid_events"] == 3, made.text
    compact(database_url, stream_path)
    assert read_messages(client, stream_path)[0] == [valid_delete, history[-1]]
    assert entity_map(client, stream_path) == {("t", "other"): {"v": 2}}


def test_a_plan_made_under_another_registration_deletes_nothing(
    client: httpx.Client, stream_path: str, pg: Any
) -> None:
    """A compaction plans under one registration, and deletes in batches afterwards. Registered
    again meanwhile with other schemas, the stream's state may come from an event the old plan
    deletes: here the second registration takes the update the first refused, and the plan
    kept only the insert. The deletes went ahead: a reader from -1 and a rebuild lost the
    value the state API showed (found by review). Now a plan's begin and its deletes carry
    the registration's version and do nothing once it changed."""
    assert client.put(stream_url(stream_path), headers=JSON).status_code == 201
    history = [change("u", "k", {"n": 1}), change("u", "k", {"n": "one"}, "update")]
    assert client.post(stream_url(stream_path), headers=JSON, content=json.dumps(history))
    strict = {"u": {"type": "object", "properties": {"n": {"type": "number"}}}}
    payload = {"stream": stream_path, "compaction": True, "tombstone_seconds": 0}
    made = client.post(f"{STATE}/streams", json=payload | {"schemas": strict})
    assert made.status_code == 201, made.text
    stream_id, version = pg.execute(
        "SELECT r.stream_id, r.version FROM ds_state_stream AS r JOIN ds_stream AS s"
        " ON s.id = r.stream_id WHERE s.path = %s",
        [stream_path],
    ).fetchone()
    horizon, floor, keep, dropped = pg.execute(
        "SELECT horizon, floor, keep, dropped_delete FROM ds_state_compaction_plan(%s, 0)",
        [stream_id],
    ).fetchone()
    assert keep == [0] and horizon == 2
    # Meanwhile: registered again, with schemas that take the update.
    assert client.delete(f"{STATE}/streams/{stream_path}").status_code == 204
    again = client.post(f"{STATE}/streams", json=payload | {"schemas": {}})
    assert again.status_code == 201, again.text
    assert entity_map(client, stream_path) == {("u", "k"): {"n": "one"}}
    began = pg.execute(
        "SELECT ds_state_compaction_begin(%s, %s, %s, %s, %s)",
        [stream_id, horizon, floor, dropped, version],
    ).fetchone()
    assert began == (False,)
    deleted = pg.execute(
        "SELECT deleted FROM ds_state_compact_delete(%s, '{1}', '{2}', %s)", [stream_id, version]
    ).fetchone()
    assert deleted == (-1,)
    assert read_messages(client, stream_path)[0] == history


@pytest.mark.parametrize(
    "timestamp",
    [
        "2026-01-01T00:00:00+23:59",
        "2026-01-01T00:00:00+24:00",
        "2026-01-01T00:00:00+22:99",
        "2026-01-01T00:00:00.1234567890Z",
        "2026-02-30T00:00:00Z",
        "2024-02-29T00:00:00Z",
        "2026-01-01T24:00:00Z",
        "2026-01-01T23:60:00Z",
        "2026-01-01T23:59:60Z",
        "2026-01-01T23:59:61Z",
        "0000-01-01T00:00:00Z",
        "2026-01-01t00:00:00z",
        "2026-01-01 00:00:00Z",
        "2026-1-01T00:00:00Z",
        "\u0662\u0660\u0662\u0666-01-01T00:00:00Z",
    ],
)
def test_the_plan_judges_a_delete_as_the_materializer_does(pg: Any, timestamp: str) -> None:
    """ds_state_delete_is_valid (SQL) against state.core.events.parse_event (Python)."""
    from state.core import InvalidEvent, parse_event

    event = change("t", "k", op="delete", timestamp=json.loads(f'"{timestamp}"'))
    try:
        parse_event(event)
        expected = True
    except InvalidEvent:
        expected = False
    judged = pg.execute("SELECT ds_state_delete_is_valid(%s::jsonb)", [json.dumps(event)])
    assert judged.fetchone() == (expected,)
