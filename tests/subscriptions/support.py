"""What the subscription tests share: a real webhook receiver (an HTTP server in a thread of the
test), signature verification against the server's JWKS, and small request helpers."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

CONTROL = "/v1/stream/__ds"


@dataclass
class Received:
    """One webhook request as the receiver got it."""

    raw: bytes
    signature: str | None
    arrived: float  # time.time()
    client_port: int
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def subscription_id(self) -> str:
        return self.body["subscription_id"]

    @property
    def generation(self) -> int:
        return self.body["generation"]

    def stream(self, path: str) -> dict[str, Any]:
        return next(s for s in self.body["streams"] if s["path"] == path)


# What the receiver answers: (status, JSON body or None). It may block (to hold a request).
Answer = Callable[[Received], tuple[int, Any]]


class Receiver:
    """A webhook receiver on 127.0.0.1: records every request, answers with ``answer``, and
    counts requests in flight per subscription (the server must never have two)."""

    def __init__(self, answer: Answer | None = None) -> None:
        self.answer: Answer = answer or (lambda received: (200, {}))
        self.received: list[Received] = []
        self.condition = threading.Condition()
        self.in_flight: Counter[str] = Counter()
        self.most_in_flight: Counter[str] = Counter()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                received = Received(
                    raw=raw,
                    signature=self.headers.get("Webhook-Signature"),
                    arrived=time.time(),
                    client_port=self.client_address[1],
                )
                with contextlib.suppress(ValueError):
                    received.body = json.loads(raw)
                sub = str(received.body.get("subscription_id"))
                with receiver.condition:
                    receiver.received.append(received)
                    receiver.in_flight[sub] += 1
                    receiver.most_in_flight[sub] = max(
                        receiver.most_in_flight[sub], receiver.in_flight[sub]
                    )
                    receiver.condition.notify_all()
                # No longer in flight once the answer is decided, before it is sent: the
                # server may record it, and send the next wake, before this thread runs again
                # (counted after the write, a loaded machine showed two in flight).
                answered = False
                try:
                    status, body = receiver.answer(received)
                    data = b"" if body is None else json.dumps(body).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    answered = receiver.answered(sub)
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the server went away (killed mid-delivery)
                finally:
                    if not answered:
                        receiver.answered(sub)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def wait_for(
        self, predicate: Callable[[list[Received]], bool], timeout: float = 30
    ) -> list[Received]:
        """Wait until ``predicate(requests so far)`` holds; the requests then."""
        deadline = time.monotonic() + timeout
        with self.condition:
            while not predicate(self.received):
                left = deadline - time.monotonic()
                assert left > 0, f"the receiver waited {timeout}s; got {len(self.received)}"
                self.condition.wait(left)
            return list(self.received)

    def wait(self, count: int, timeout: float = 30) -> list[Received]:
        return self.wait_for(lambda got: len(got) >= count, timeout)

    def of(self, subscription_id: str) -> list[Received]:
        with self.condition:
            return [r for r in self.received if r.body.get("subscription_id") == subscription_id]

    def answered(self, sub: str) -> bool:
        """One request of ``sub`` answered: no longer in flight."""
        with self.condition:
            self.in_flight[sub] -= 1
        return True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def verify_signature(received: Received, jwks: dict[str, Any], *, window: int = 300) -> bool:
    """PROTOCOL.md 7.1, 12.10, as a receiver checks it: ``t=,kid=,ed25519=``, the key chosen
    by kid from the JWKS, an Ed25519 signature over ``<t>.<raw body>``, t within the window."""
    if received.signature is None:
        return False
    fields = dict(part.split("=", 1) for part in received.signature.split(","))
    if set(fields) != {"t", "kid", "ed25519"} or not fields["t"].isdigit():
        return False
    if abs(time.time() - int(fields["t"])) > window:
        return False
    key = next((k for k in jwks["keys"] if k["kid"] == fields["kid"]), None)
    if key is None or (key["kty"], key["crv"], key["alg"]) != ("OKP", "Ed25519", "EdDSA"):
        return False
    public = Ed25519PublicKey.from_public_bytes(b64url_decode(key["x"]))
    try:
        public.verify(b64url_decode(fields["ed25519"]), f"{fields['t']}.".encode() + received.raw)
    except InvalidSignature:
        return False
    return True


def put_subscription(client: httpx.Client, sub_id: str, **config: Any) -> httpx.Response:
    return client.put(f"{CONTROL}/subscriptions/{sub_id}", json=config)


def get_subscription(client: httpx.Client, sub_id: str) -> dict[str, Any]:
    response = client.get(f"{CONTROL}/subscriptions/{sub_id}")
    assert response.status_code == 200, response.text
    return response.json()


def acked(client: httpx.Client, sub_id: str) -> dict[str, str]:
    """Each followed stream's acked offset."""
    return {s["path"]: s["acked_offset"] for s in get_subscription(client, sub_id)["streams"]}


def wait_until(predicate: Callable[[], bool], timeout: float = 30, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not reached within {timeout}s"
        time.sleep(interval)


def report(
    client: httpx.Client,
    sub_id: str,
    action: str,
    token: str,
    wake_id: str,
    generation: int,
    acks: list[tuple[str, str]] = (),  # type: ignore[assignment]
    done: bool = True,
) -> httpx.Response:
    """POST a callback, ack or release (PROTOCOL.md 7.1, 7.2)."""
    body: dict[str, Any] = {"wake_id": wake_id, "generation": generation, "done": done}
    if acks:
        body["acks"] = [{"stream": s, "offset": o} for s, o in acks]
    return client.post(
        f"{CONTROL}/subscriptions/{sub_id}/{action}",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
    )
