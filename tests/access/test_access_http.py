"""Access control through real HTTP on every endpoint and method (PROTOCOL.md 12.1; issue 9).

Two server processes in ``keys`` mode share one database. For each operation (streams,
forks, live reads, Yjs documents and awareness, the state API) and each kind of credential
(none, an unknown key, an expired key, a revoked key, a key for another prefix, a key without
the operation, the same as identity-provider tokens), the answer's status is checked and the
world is re-read to prove that a refused request changed nothing; with the right grant, the
operation succeeds.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from pycrdt import Doc, Text

from tests.access.support import KID, IdentityProvider, bearer, create_key, key_id
from tests.conftest import ServerProcess, manage

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}
FULL = ("stream/acl/:read,append,manage", "yjs/acl/:read,append,manage")


@pytest.fixture(scope="module")
def idp(tmp_path_factory: pytest.TempPathFactory) -> IdentityProvider:
    return IdentityProvider.create(tmp_path_factory.mktemp("idp"))


@pytest.fixture(scope="module")
def servers(start_server: Any, idp: IdentityProvider) -> tuple[ServerProcess, ServerProcess]:
    env = {"DS_AUTH__MODE": "keys", **idp.env()}
    return start_server(env=env), start_server(env=env)


@pytest.fixture(scope="module")
def keys(database_url: str, servers: Any, idp: IdentityProvider) -> dict[str, dict[str, str]]:
    """Headers of each kind of credential."""
    made = {
        "admin": create_key(database_url, "admin", ":read,append,manage"),
        "full": create_key(database_url, "full", *FULL),
        "reader": create_key(database_url, "reader", "stream/acl/:read", "yjs/acl/:read"),
        "appender": create_key(database_url, "appender", "stream/acl/:append", "yjs/acl/:append"),
        "no-manage": create_key(
            database_url, "no-manage", "stream/acl/:read,append", "yjs/acl/:read,append"
        ),
        "outside": create_key(
            database_url, "outside", "stream/other/:read,append,manage", "yjs/other/:read,append"
        ),
        "expired": create_key(database_url, "expired", *FULL, extra=("--expires-in", "1")),
        "revoked": create_key(database_url, "revoked", *FULL),
    }
    # The revoked key works on the second process first (so that process has it cached), then
    # is revoked by another process (the command) and must stop working there.
    second = servers[1]
    assert httpx.get(
        f"{second.base_url}/v1/auth/whoami", headers=bearer(made["revoked"])
    ).is_success
    assert manage(database_url, "revoke_api_key", key_id(made["revoked"])).returncode == 0
    time.sleep(1.1)  # the expired key's second has passed
    headers = {name: bearer(key) for name, key in made.items()}
    headers["none"] = {}
    headers["unknown"] = bearer("AbCdEfGh.nosuchkeynosuchkeynosuchkeynosu")
    headers["garbage"] = {"Authorization": "Basic dXNlcjpwYXNz"}
    headers["jwt-full"] = bearer(idp.token(list(FULL)))
    headers["jwt-reader"] = bearer(idp.token(["stream/acl/:read", "yjs/acl/:read"]))
    headers["jwt-expired"] = bearer(idp.token(list(FULL), expires_in=-10))
    headers["jwt-audience"] = bearer(idp.token(list(FULL), aud="someone-else"))
    # An algorithm the key cannot verify with (ES256 on the RSA key), and a junk signature:
    # PyJWT raised TypeError, a 500 for anyone on every surface (probe 10h).
    signed = idp.token(list(FULL)).split(".")
    foreign = {"alg": "ES256", "kid": KID, "typ": "JWT"}
    header = base64.urlsafe_b64encode(json.dumps(foreign).encode()).rstrip(b"=").decode()
    headers["jwt-wrong-key"] = bearer(f"{header}.{signed[1]}.AAAA")
    # PyJWT takes both: every token without a subject one principal, an expiry as text.
    headers["jwt-no-subject"] = bearer(idp.token(list(FULL), sub=""))
    headers["jwt-text-expiry"] = bearer(idp.token(list(FULL), exp=str(int(time.time()) + 600)))
    return headers


@dataclass
class World:
    """What one operation may touch: a text stream with data, a JSON stream registered as a
    state stream, a Yjs document with an update and an awareness stream."""

    base: str
    stream: str
    state: str
    doc: str
    admin: dict[str, str]


def _update(text: str) -> bytes:
    doc = Doc()
    doc["t"] = content = Text()
    content += text
    update = doc.get_update()
    return bytes([len(update)]) + update if len(update) < 128 else _framed(update)


def _framed(update: bytes) -> bytes:
    length, out = len(update), bytearray()
    while True:
        byte = length & 0x7F
        length >>= 7
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out) + update


@pytest.fixture
def world(servers: Any, keys: dict[str, dict[str, str]]) -> World:
    first = servers[0]
    name = f"w{time.time_ns()}"
    world = World(
        base=first.base_url,
        stream=f"acl/{name}/text",
        state=f"acl/{name}/state",
        doc=f"/v1/yjs/acl/docs/{name}",
        admin=keys["admin"],
    )
    with httpx.Client(base_url=first.base_url, headers=world.admin, timeout=10) as http:
        assert (
            http.put(f"/v1/stream/{world.stream}", headers=TEXT, content="hello").status_code == 201
        )
        event = {"type": "user", "key": "u1", "value": {"n": 1}, "headers": {"operation": "insert"}}
        assert http.put(f"/v1/stream/{world.state}", headers=JSON, json=[event]).status_code == 201
        assert http.post("/v1/state/streams", json={"stream": world.state}).status_code == 201
        assert http.put(world.doc).status_code == 201
        update = _update("doc text")
        octets = {"Content-Type": "application/octet-stream"}
        assert http.post(world.doc, headers=octets, content=update).status_code == 204
        aware = f"{world.doc}?awareness=cursors"
        assert http.put(aware).status_code == 201
    return world


def snapshot(world: World) -> dict[str, Any]:
    """Everything an operation could change, read with the admin key."""
    seen: dict[str, Any] = {}
    with httpx.Client(base_url=world.base, headers=world.admin, timeout=10) as http:
        for path in (world.stream, f"{world.stream}-new", f"{world.stream}-fork", world.state):
            head = http.head(f"/v1/stream/{path}")
            body = http.get(f"/v1/stream/{path}", params={"offset": "-1"}).content
            seen[path] = (head.status_code, head.headers.get("Stream-Next-Offset"), body)
        seen["registered"] = http.get(f"/v1/state/streams/{world.state}").status_code
        seen["entities"] = http.get("/v1/state/entities", params={"stream": world.state}).text
        seen["doc"] = http.get(world.doc, params={"offset": "-1"}).content
        aware = http.get(world.doc, params={"awareness": "cursors", "offset": "-1"})
        seen["awareness"] = (aware.status_code, aware.content)
        other = http.head(f"{world.doc}-new")
        seen["doc-new"] = other.status_code
    return seen


Request = Callable[[httpx.Client, World], httpx.Response]


def _sse_first_event(http: httpx.Client, url: str, **kwargs: Any) -> httpx.Response:
    with http.stream("GET", url, **kwargs) as response:
        if response.status_code == 200:
            for line in response.iter_lines():
                if line.startswith("event:"):
                    break
        else:
            response.read()
        return response


OCTETS = {"Content-Type": "application/octet-stream"}

# name -> (operation needed, request, statuses of success)
OPERATIONS: dict[str, tuple[str, Request, set[int]]] = {
    "stream PUT": (
        "manage",
        lambda h, w: h.put(f"/v1/stream/{w.stream}-new", headers=TEXT, content="x"),
        {201},
    ),
    "stream fork PUT": (
        "manage",
        lambda h, w: h.put(
            f"/v1/stream/{w.stream}-fork", headers={"Stream-Forked-From": f"/v1/stream/{w.stream}"}
        ),
        {201},
    ),
    "stream POST": (
        "append",
        lambda h, w: h.post(f"/v1/stream/{w.stream}", headers=TEXT, content=" more"),
        {204},
    ),
    "stream POST close": (
        "append",
        lambda h, w: h.post(f"/v1/stream/{w.stream}", headers={"Stream-Closed": "true"}),
        {204},
    ),
    "stream GET": ("read", lambda h, w: h.get(f"/v1/stream/{w.stream}?offset=-1"), {200}),
    "stream long-poll": (
        "read",
        lambda h, w: h.get(f"/v1/stream/{w.stream}", params={"offset": "-1", "live": "long-poll"}),
        {200},
    ),
    "stream SSE": (
        "read",
        lambda h, w: _sse_first_event(
            h, f"/v1/stream/{w.stream}", params={"offset": "-1", "live": "sse"}
        ),
        {200},
    ),
    "stream HEAD": ("read", lambda h, w: h.head(f"/v1/stream/{w.stream}"), {200}),
    "stream DELETE": ("manage", lambda h, w: h.delete(f"/v1/stream/{w.stream}"), {204}),
    "doc PUT": ("manage", lambda h, w: h.put(f"{w.doc}-new"), {201}),
    "doc POST": (
        "append",
        lambda h, w: h.post(w.doc, headers=OCTETS, content=_update("more")),
        {204},
    ),
    "doc GET": ("read", lambda h, w: h.get(w.doc, params={"offset": "-1"}), {200}),
    "doc snapshot": ("read", lambda h, w: h.get(w.doc, params={"offset": "snapshot"}), {307}),
    "doc SSE": (
        "read",
        lambda h, w: _sse_first_event(h, w.doc, params={"offset": "-1", "live": "sse"}),
        {200},
    ),
    "doc HEAD": ("read", lambda h, w: h.head(w.doc), {200}),
    "doc DELETE": ("manage", lambda h, w: h.delete(w.doc), {204}),
    "awareness PUT": ("manage", lambda h, w: h.put(f"{w.doc}?awareness=other"), {201}),
    "awareness POST": (
        "append",
        lambda h, w: h.post(f"{w.doc}?awareness=cursors", headers=OCTETS, content=b"\x01\x02"),
        {204},
    ),
    "awareness GET": (
        "read",
        lambda h, w: h.get(w.doc, params={"awareness": "cursors", "offset": "-1"}),
        {200},
    ),
    "state register": (
        "manage",
        lambda h, w: h.post("/v1/state/streams", json={"stream": w.stream}),
        {409},  # a text stream cannot be a state stream: judged only once allowed
    ),
    "state detail": ("read", lambda h, w: h.get(f"/v1/state/streams/{w.state}"), {200}),
    "state entities": (
        "read",
        lambda h, w: h.get("/v1/state/entities", params={"stream": w.state}),
        {200},
    ),
    "state unregister": ("manage", lambda h, w: h.delete(f"/v1/state/streams/{w.state}"), {204}),
}

LACKING = {"read": "appender", "append": "reader", "manage": "no-manage"}
REFUSED = {
    "none": 401,
    "unknown": 401,
    "garbage": 401,
    "expired": 401,
    "revoked": 401,
    "outside": 403,
    "jwt-expired": 401,
    "jwt-audience": 401,
    "jwt-wrong-key": 401,
    "jwt-no-subject": 401,
    "jwt-text-expiry": 401,
}


@pytest.fixture(params=sorted(OPERATIONS))
def operation(request: pytest.FixtureRequest) -> str:
    return request.param


def _client(server: ServerProcess, headers: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=15) as http:
        yield http


def test_refused_credentials_change_nothing(
    servers: Any, keys: dict[str, dict[str, str]], world: World, operation: str
) -> None:
    """No credentials, bad ones (unknown, expired, revoked on another process, a JWT of
    another audience or expired) are 401 with WWW-Authenticate; a key for another prefix and
    a key without the operation are 403; the body says which; nothing changes."""
    needed, send, _ = OPERATIONS[operation]
    before = snapshot(world)
    cases = dict(REFUSED) | {LACKING[needed]: 403}
    if needed != "read":
        cases["jwt-reader"] = 403
    second = servers[1]
    for credential, status in cases.items():
        for http in _client(second, keys[credential]):
            response = send(http, world)
            assert response.status_code == status, (operation, credential, response.text)
            if status == 401:
                assert "Bearer" in response.headers["WWW-Authenticate"], (operation, credential)
    assert snapshot(world) == before, operation


@pytest.mark.parametrize("credential", ["full", "jwt-full"])
def test_the_right_grant_succeeds(
    servers: Any, keys: dict[str, dict[str, str]], world: World, operation: str, credential: str
) -> None:
    """The same operations with a key (and a token) granted them succeed."""
    _, send, statuses = OPERATIONS[operation]
    for http in _client(servers[1], keys[credential]):
        response = send(http, world)
        assert response.status_code in statuses, (operation, response.status_code, response.text)
