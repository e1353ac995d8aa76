"""JSON Schemas from clients are input too (STATE-PROTOCOL.md 7; POST /v1/state/streams needs
only the right to manage the stream): a schema may not make the server fetch anything, and
no value judged against it may stall a worker or answer 500 (state/core/schemas.py).

Found by an adversarial probe: a ``$ref`` to a URL or a file was fetched, at registration and
again when explaining a refused value, and what came back was shown in the 400; a ``pattern``
with nested quantifiers ran Python's backtracking ``re`` on the value (one append kept a worker
busy until uvicorn killed it); and a recursive schema explained a deeply nested value by
recursing in Python (500).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, manage
from tests.state.support import (
    append,
    append_ok,
    change,
    create_json_stream,
    entity_map,
    register,
)

# What a request may take before the test calls it stalled: generous on a loaded machine, and
# far below what the backtracking took (minutes for these inputs).
STALLED_SECS = 30.0


@pytest.fixture(scope="module")
def own_client(start_server: object) -> Iterator[httpx.Client]:
    """A server of this module's own: before the fix, a stalled worker would have kept every
    other test's requests waiting."""
    server: ServerProcess = start_server()  # type: ignore[operator]
    with httpx.Client(base_url=server.base_url, timeout=STALLED_SECS) as http:
        yield http


@pytest.mark.parametrize("pattern", ["^(a+)+$", "^(a|aa)+$"], ids=["nested", "alt"])
def test_a_backtracking_pattern_is_judged_at_once(
    own_client: httpx.Client, stream_path: str, pattern: str
) -> None:
    """A value that makes a backtracking engine try every split of its 40 characters is
    refused (400) in an ordinary request, and the worker goes on answering."""
    create_json_stream(own_client, stream_path)
    schema = {"type": "object", "properties": {"w": {"type": "string", "pattern": pattern}}}
    assert register(own_client, stream_path, {"t": schema}).status_code == 201
    response = append(own_client, stream_path, [change("t", "k", {"w": "a" * 40 + "!"})])
    assert response.status_code == 400, response.text
    assert "does not match its schema" in response.text
    append_ok(own_client, stream_path, [change("t", "k", {"w": "a" * 40})])


def test_patterns_only_a_backtracking_engine_runs_are_refused(
    own_client: httpx.Client, stream_path: str
) -> None:
    """Lookaround and backreferences need a backtracking engine, whose step limit bounds one
    match (45 ms), not a value: 100 strings under ``anyOf`` took 4.7 s (found by review). Such
    patterns are refused at registration (400), in ``pattern`` and ``patternProperties``."""
    create_json_stream(own_client, stream_path)
    for schema in (
        {"items": {"anyOf": [{"pattern": "^(a|a)*\\1b$"}, {"type": "string"}]}},
        {"type": "string", "pattern": "^(?=a)(a+)+$"},
        {"patternProperties": {"^(?!x)": {"type": "integer"}}},
    ):
        response = register(own_client, stream_path, {"t": schema})
        assert response.status_code == 400, (schema, response.text)


def test_a_schema_may_not_refer_to_other_documents(
    own_client: httpx.Client, stream_path: str
) -> None:
    """A ``$ref`` to a URL (here a listener of the test's own) or to a file is refused at
    registration (400), and the server connects to nothing."""
    create_json_stream(own_client, stream_path)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        for ref in (f"http://127.0.0.1:{port}/secret.json", "file:///etc/hostname"):
            response = register(own_client, stream_path, {"t": {"$ref": ref}})
            assert response.status_code == 400, response.text
            assert "cannot be used" in response.text
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_a_value_nested_past_what_the_validator_checks_is_refused(
    own_client: httpx.Client, stream_path: str
) -> None:
    """A recursive schema refusing every level of a value nested as deep as JSON may nest here
    (128 levels with the append's array and the event): a 400, not a 500. (Nested 900 deep,
    which the decoder then took, it was a 400 saying the value could not be checked.)"""
    create_json_stream(own_client, stream_path)
    schema = {
        "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 0}},
        "$ref": "#/$defs/n",
    }
    assert register(own_client, stream_path, {"t": schema}).status_code == 201
    nested: list = []
    for _ in range(125):
        nested = [nested]
    response = append(own_client, stream_path, [change("t", "k", nested)])
    assert response.status_code == 400, response.text
    assert "does not match its schema" in response.text
    append_ok(own_client, stream_path, [change("t", "k", [])])


def _shared_ref_chain(length: int) -> dict:
    """``a1 = allOf[a0, a0]``, ``a2 = allOf[a1, a1]`` ...: ``a0`` is applied 2^length times to
    every value (jsonschema-rs compiles it at once and follows every path when checking)."""
    defs: dict = {"a0": {"type": "string", "pattern": "^[a-z]+$"}}
    for i in range(1, length + 1):
        defs[f"a{i}"] = {"allOf": [{"$ref": f"#/$defs/a{i - 1}"}, {"$ref": f"#/$defs/a{i - 1}"}]}
    return {"$defs": defs, "$ref": f"#/$defs/a{length}"}


def test_a_schema_that_checks_a_value_exponentially_often_is_refused(
    own_client: httpx.Client, stream_path: str
) -> None:
    """A ``$ref`` chain 40 long would check a three-letter string 2^40 times, holding Python's
    global lock (jsonschema-rs): one append would stop the worker for hours (found by review;
    registered with 201 before). It is refused at registration, with what it would cost, as is
    a recursive schema applying itself twice at every level below. A chain 8 long costs 256
    keywords per value and is accepted, and its values are judged."""
    create_json_stream(own_client, stream_path)
    branching = {"properties": {"kids": {"allOf": [{"$ref": "#"}, {"$ref": "#"}]}}}
    for schema in (_shared_ref_chain(40), branching, {"$ref": "#"}):
        response = register(own_client, stream_path, {"t": schema})
        assert response.status_code == 400, (schema, response.text)
        assert "too costly" in response.text or "without end" in response.text, response.text
    assert register(own_client, stream_path, {"t": _shared_ref_chain(8)}).status_code == 201
    append_ok(own_client, stream_path, [change("t", "k", "abc")])
    response = append(own_client, stream_path, [change("t", "k", "ab1")])
    assert response.status_code == 400, response.text


def test_a_large_value_against_many_patterns_gets_a_short_refusal(
    own_client: httpx.Client, stream_path: str
) -> None:
    """50 patterns under ``anyOf`` against a 4 MiB string: the check held Python's global lock
    for 0.1 s and its explanation for seconds, quoting the string in every branch, so the 400
    carried the 4 MiB back (found by a probe: four such appends stopped both workers for 15 s).
    It is checked in a checker process now (state.checker), and refused with a short answer
    that names what failed and where; a matching value is stored."""
    create_json_stream(own_client, stream_path)
    branches = [{"pattern": f"^[a-y]+[0-9]{chr(97 + i % 26)}$"} for i in range(50)]
    schema = {"type": "object", "properties": {"s": {"anyOf": branches}}}
    assert register(own_client, stream_path, {"t": schema}).status_code == 201
    response = append(own_client, stream_path, [change("t", "k", {"s": "a" * (4 << 20)})])
    assert response.status_code == 400, response.text[:300]
    assert len(response.content) < 1000, response.text[:300]
    assert "does not match its schema at ['s']" in response.text, response.text
    append_ok(own_client, stream_path, [change("t", "k", {"s": "abc1a"})])
    response = append(own_client, stream_path, [change("t", "k", {"s": "abc" * 1000})])
    assert response.status_code == 400, response.text
    assert "does not match its schema" in response.text


def test_a_refusal_does_not_quote_the_value(own_client: httpx.Client, stream_path: str) -> None:
    """What a value failed is said without repeating the value (jsonschema-rs's ``mask``):
    before, a refused string came back whole in the 400, whatever its size."""
    create_json_stream(own_client, stream_path)
    schema = {"type": "object", "properties": {"w": {"type": "string", "pattern": "^a+$"}}}
    assert register(own_client, stream_path, {"t": schema}).status_code == 201
    response = append(own_client, stream_path, [change("t", "k", {"w": "do-not-echo-me"})])
    assert response.status_code == 400, response.text
    assert "does not match" in response.text and "^a+$" in response.text, response.text
    assert "do-not-echo-me" not in response.text


# Checks past a second (and a second per MiB) are past their deadline.
ONE_SECOND_CHECKS: dict[str, str | None] = {"DS_STATE__CHECK_TIMEOUT_SECS": "1"}


def _thrashing(seed: int) -> tuple[str, list[dict[str, str]]]:
    """1.7 MB of random a/b text, and patterns whose lazy DFA thrashes on it (``a[ab]{50}c``:
    about 860 ns a byte, where most patterns take 1-2): seconds of checking."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab") for _ in range(1_700_000))
    return text, [{"pattern": f"a[ab]{{{n}}}c"} for n in range(31, 51)]


def _while_answering(
    base_url: str, send: Callable[[], httpx.Response]
) -> tuple[httpx.Response, bool]:
    """``send``'s answer, and whether the server answered another client (``/healthz``,
    asked half a second after ``send`` began) before it."""
    finished: dict[str, float] = {}
    answers: list[httpx.Response] = []

    def sending() -> None:
        answers.append(send())
        finished["send"] = time.monotonic()

    worker = threading.Thread(target=sending)
    worker.start()
    time.sleep(0.5)  # the request's body is in, its events being checked
    with httpx.Client(base_url=base_url, timeout=STALLED_SECS) as other:
        assert other.get("/healthz").status_code == 200
    finished["other"] = time.monotonic()
    worker.join()
    return answers[0], finished["other"] < finished["send"]


def _chain_defs(length: int, prefix: str = "#/$defs/") -> dict:
    defs: dict = {"a0": {"type": "string", "pattern": "^[a-z]+$"}}
    for i in range(1, length + 1):
        ref = {"$ref": f"{prefix}a{i - 1}"}
        defs[f"a{i}"] = {"allOf": [ref, dict(ref)]}
    return defs


def _refuge(length: int) -> dict:
    """A chain hidden behind an embedded resource: the analysis once resolved the relative
    ``$ref`` against an ``$id`` jsonschema-rs ignores there (under a property named
    ``default``), found a cheap ``true``, and registered the chain (found by review)."""
    cheap = {f"a{i}": True for i in range(length + 1)}
    embedded = {"$id": "https://other.example/s", "$defs": _chain_defs(length)}
    return {
        "$defs": cheap,
        "properties": {"default": {**embedded, "$ref": f"#/$defs/a{length}"}},
    }


@pytest.mark.parametrize(
    "schema",
    [
        _refuge(40),
        {
            "$ref": "#/contentSchema/$defs/a40",
            "contentSchema": {"$id": "https://other.example/c", "$defs": _chain_defs(40)},
            "$defs": {f"a{i}": True for i in range(41)},
        },
        {"$ref": "https://example.com/elsewhere#/x"},
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"a": {"type": "string"}},
            "$ref": "#/definitions/a",
            "allOf": [{"$ref": "#/allOf/%C2%B2"}],
        },
        {"$defs": {"x": {"$anchor": "a"}, "y": {"$anchor": "a"}}, "$ref": "#a"},
        {"properties": {"kids": {"allOf": [{"$ref": "#"}, {"$ref": "#"}]}}},
        {"items": {"$ref": "#"}, "contains": {"$ref": "#"}},
    ],
    ids=[
        "embedded-id",
        "id-in-content-schema",
        "other-document",
        "bad-index",
        "anchor-twice",
        "branching",
        "twice-below",
    ],
)
def test_schemas_whose_cost_cannot_be_bounded_are_refused(
    own_client: httpx.Client, stream_path: str, schema: dict
) -> None:
    """References this server does not follow as jsonschema-rs does (embedded resources, also
    under ``contentSchema``, which jsonschema-rs indexes but never applies: a chain registered
    as cheap and plain through it, found by review; other documents, an anchor defined
    twice), a bad array index (a 500 before: found by review), and recursion that checks each
    level more than once: 400 at registration."""
    create_json_stream(own_client, stream_path)
    response = register(own_client, stream_path, {"t": schema})
    assert response.status_code == 400, response.text


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        ({"properties": {"left": {"$ref": "#"}, "right": {"$ref": "#"}}}, {"left": {"right": {}}}),
        (
            {
                "$defs": {
                    "v": {
                        "anyOf": [
                            {"type": ["string", "number", "boolean", "null"]},
                            {"type": "array", "items": {"$ref": "#/$defs/v"}},
                            {"type": "object", "additionalProperties": {"$ref": "#/$defs/v"}},
                        ]
                    }
                },
                "$ref": "#/$defs/v",
            },
            {"a": [1, {"b": [None, "x"]}]},
        ),
        (
            {
                "$dynamicAnchor": "node",
                "type": "object",
                "properties": {"children": {"type": "array", "items": {"$dynamicRef": "#node"}}},
            },
            {"children": [{"children": []}]},
        ),
        (
            {"$id": "urn:example:root", "$defs": {"x": {"type": "object"}}, "$ref": "#/$defs/x"},
            {},
        ),
    ],
    ids=["binary-tree", "any-json", "dynamic-tree", "urn-id"],
)
def test_common_recursive_schemas_are_accepted(
    own_client: httpx.Client, stream_path: str, schema: dict, value: object
) -> None:
    """Recursive schemas that check each place of a value a bounded number of times (a binary
    tree, any JSON value, the specification's $dynamicRef tree) and a root ``$id`` that is a
    URN register and judge values (the first analysis counted every branch below and refused
    them, or could not resolve against a URN: found by review)."""
    create_json_stream(own_client, stream_path)
    response = register(own_client, stream_path, {"t": schema})
    assert response.status_code == 201, response.text
    append_ok(own_client, stream_path, [change("t", "k", value)])


def test_an_append_of_many_costly_values_leaves_the_worker_answering(
    own_client: httpx.Client, stream_path: str
) -> None:
    """40 values each within its budget against 41 patterns (about 60 ms each), then one the
    schema refuses: the append was checked on the event loop (500 events or fewer were),
    holding it for seconds (found by review: 30 s), so another client's request was answered
    only after the refusal. Checked in a checker process now (state.checker), the worker
    answers the other client while the append is being checked, and the append is refused
    all the same (400, nothing stored)."""
    create_json_stream(own_client, stream_path)
    patterns = [{"pattern": f"^[a-z]*{chr(65 + i % 26)}{i}$"} for i in range(40)]
    schema = {"anyOf": [*patterns, {"pattern": "^a*$"}]}
    assert register(own_client, stream_path, {"t": schema}).status_code == 201
    events = [change("t", f"k{i}", "a" * 550_000) for i in range(40)]
    events.append(change("t", "last", "refused!"))
    answer, answered_meanwhile = _while_answering(
        str(own_client.base_url), lambda: append(own_client, stream_path, events)
    )
    assert answer.status_code == 400, answer.text[:300]
    assert "event 40" in answer.text
    assert answered_meanwhile


def test_a_check_past_its_deadline_is_refused_and_the_worker_answers_meanwhile(
    start_server: Any, stream_path: str
) -> None:
    """Patterns whose regular expressions thrash their lazy DFA (``a[ab]{50}c``: about 860 ns
    a byte on random a/b text, where most patterns take 1-2) against 1.7 MB of it: seconds of
    a check that held Python's global lock, so the worker answered nothing meanwhile, and at
    5 s uvicorn killed it (found by a probe; no static cost bound caught such patterns). The
    check runs in a process of its own now: past its deadline (here 1 s and 1 s per MiB) the
    append is refused (400, nothing stored), and another client is answered while it runs."""
    server: ServerProcess = start_server(env=ONE_SECOND_CHECKS)
    text, thrashing = _thrashing(seed=7)
    with httpx.Client(base_url=server.base_url, timeout=STALLED_SECS) as client:
        create_json_stream(client, stream_path)
        schema = {"type": "string", "anyOf": thrashing}
        assert register(client, stream_path, {"t": schema}).status_code == 201
        matching = "a" + "b" * 50 + "c"
        append_ok(client, stream_path, [change("t", "k", matching)])  # the checker is up
        answer, answered_meanwhile = _while_answering(
            server.base_url, lambda: append(client, stream_path, [change("t", "k", text)])
        )
        assert answer.status_code == 400, answer.text[:300]
        assert "could not be checked" in answer.text
        assert answered_meanwhile
        read = client.get(f"/v1/stream/{stream_path}", params={"offset": "-1"})
        assert len(read.json()) == 1  # only the first append
        append_ok(client, stream_path, [change("t", "k", matching)])  # a new checker


def test_appends_waiting_for_a_checker_wait_no_longer_than_a_check(
    start_server: Any, stream_path: str
) -> None:
    """Six appends, each costing its checker its whole deadline (2.6 s: 1 s and 1 s per MiB),
    against the two checkers of one process: the last ones waited for a checker without
    bound (7.8 s for the sixth; every state append of the process with a schema that is not
    plain queued behind them). Now an append waits for a checker at most the check's timeout
    (1 s here), then answers 503 with Retry-After: nothing is wrong with it."""
    server: ServerProcess = start_server(env=ONE_SECOND_CHECKS)
    text, thrashing = _thrashing(seed=13)
    with httpx.Client(base_url=server.base_url, timeout=STALLED_SECS) as client:
        create_json_stream(client, stream_path)
        assert register(client, stream_path, {"t": {"anyOf": thrashing}}).status_code == 201
        append_ok(client, stream_path, [change("t", "k", "a" + "b" * 50 + "c")])
        answers: list[httpx.Response] = []

        def costly() -> None:
            with httpx.Client(base_url=server.base_url, timeout=STALLED_SECS) as own:
                answers.append(append(own, stream_path, [change("t", "k", text)]))

        senders = [threading.Thread(target=costly) for _ in range(6)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        statuses = sorted(answer.status_code for answer in answers)
        assert set(statuses) <= {400, 503}, [a.text[:200] for a in answers]
        assert 503 in statuses, statuses
        for answer in answers:
            if answer.status_code == 503:
                assert int(answer.headers["Retry-After"]) > 0
        read = client.get(f"/v1/stream/{stream_path}", params={"offset": "-1"})
        assert len(read.json()) == 1  # none of them stored
        append_ok(client, stream_path, [change("t", "k", "a" + "b" * 50 + "c")])


def test_a_registration_over_a_history_too_costly_to_check_is_refused_meanwhile_answering(
    start_server: Any, stream_path: str
) -> None:
    """A stream holding 1.7 MB of random a/b text, then a registration whose patterns thrash
    on it: the registration checked the history in the server's process (a Django thread,
    holding Python's global lock for seconds: found by review). It is checked in a process of
    its own now, within the check's deadline: past it, the registration is refused (400,
    nothing registered), and the worker answers another client meanwhile. A history that
    checks in time registers, its refused events counted as before."""
    server: ServerProcess = start_server(env=ONE_SECOND_CHECKS)
    text, thrashing = _thrashing(seed=11)
    with httpx.Client(base_url=server.base_url, timeout=STALLED_SECS) as client:
        create_json_stream(client, stream_path)
        append_ok(client, stream_path, [change("t", "k", text)])
        answer, answered_meanwhile = _while_answering(
            server.base_url,
            lambda: register(client, stream_path, {"t": {"type": "string", "anyOf": thrashing}}),
        )
        assert answer.status_code == 400, answer.text[:300]
        assert "history could not be checked" in answer.text
        assert answered_meanwhile
        assert client.get(f"/v1/state/streams/{stream_path}").status_code == 404
        append_ok(client, stream_path, [change("t", "j", "a" + "b" * 50 + "c")])
        schema = {"type": "string", "pattern": "^a[ab]*c$"}
        registered = register(client, stream_path, {"t": schema})
        assert registered.status_code == 201, registered.text
        assert registered.json()["invalid_events"] == 1  # the long text has no c


def test_a_large_value_accepted_at_append_survives_a_rebuild(
    own_client: httpx.Client, stream_path: str, database_url: str
) -> None:
    """A 3 MB value against a plain schema is accepted when appended (checked in a checker
    process, with no size budget), and a rebuild keeps it: the rebuild judged it in-process
    within the size budget and dropped it as invalid (found while moving checks out)."""
    create_json_stream(own_client, stream_path)
    assert register(own_client, stream_path, {"t": {"type": "object"}}).status_code == 201
    append_ok(own_client, stream_path, [change("t", "big", {"s": "x" * 3_000_000})])
    rebuilt = manage(database_url, "materialize_state", "--rebuild", "--stream", stream_path)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "0 invalid events" in rebuilt.stdout, rebuilt.stdout
    assert len(entity_map(own_client, stream_path)[("t", "big")]["s"]) == 3_000_000
