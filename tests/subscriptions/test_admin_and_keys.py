"""The Django admin of subscriptions (their cursors, the wake in flight, retries; pause, resume
and cursor resets through the SQL functions) and webhook signing key rotation
(``manage.py rotate_webhook_key``, PROTOCOL.md 6.5), through the real server."""

from __future__ import annotations

import re
import time

import httpx

from subscriptions.signing import KEY_CACHE_SECONDS
from tests.conftest import manage
from tests.http.test_admin import admin_client, run_action
from tests.subscriptions.support import (
    CONTROL,
    Receiver,
    acked,
    put_subscription,
    verify_signature,
    wait_until,
)

__all__ = ["admin_client"]  # the fixture, shared with the streams' admin tests
ZERO = "0000000000000000_0000000000000000"


def test_admin_shows_cursors_and_pauses_resumes_and_resets(
    admin_client: httpx.Client, client: httpx.Client
) -> None:
    prefix = f"adm{time.time_ns()}"
    sub = f"{prefix}-sub"
    client.put(f"/v1/stream/{prefix}/wake", headers={"Content-Type": "application/json"})
    config = {"type": "pull-wake", "pattern": f"{prefix}/e/*", "wake_stream": f"{prefix}/wake"}
    assert put_subscription(client, sub, **config).status_code == 201
    tail = client.put(
        f"/v1/stream/{prefix}/e/one", content=b"abc", headers={"Content-Type": "text/plain"}
    ).headers["Stream-Next-Offset"]

    listing = admin_client.get("/admin/subscriptions/subscription/", params={"q": sub})
    assert listing.status_code == 200 and sub in listing.text
    found = re.search(r'href="/admin/subscriptions/subscription/(\d+)/change/', listing.text)
    assert found is not None
    page = admin_client.get(f"/admin/subscriptions/subscription/{found.group(1)}/change/")
    assert page.status_code == 200
    assert f"{prefix}/e/one" in page.text and "/admin/streams/stream/" in page.text
    assert "Wake in flight" in page.text and "Retries" in page.text
    assert admin_client.get("/admin/subscriptions/subscription/add/").status_code == 403

    paused = run_action(admin_client, listing, "pause", found.group(1))
    assert paused.status_code == 200 and "1 subscription(s) paused" in paused.text
    url = f"{CONTROL}/subscriptions/{sub}/claim"
    # Paused: a wake issued before the pause may still be claimed and ended; then no new one.
    first = client.post(url, json={"worker": "w"})
    if first.status_code == 200:
        body = first.json()
        client.post(
            f"{CONTROL}/subscriptions/{sub}/release",
            json={"wake_id": body["wake_id"], "generation": body["generation"]},
            headers={"Authorization": f"Bearer {body['token']}"},
        )
    refused = client.post(url, json={"worker": "w"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "SUBSCRIPTION_PAUSED"

    resumed = run_action(admin_client, listing, "resume", found.group(1))
    assert "1 subscription(s) resumed" in resumed.text
    assert client.post(url, json={"worker": "w"}).status_code == 200

    run_action(admin_client, listing, "reset_to_tail", found.group(1))
    assert acked(client, sub) == {f"{prefix}/e/one": tail}
    # The reset fenced the claim: the subscription can be claimed again only for new work.
    assert client.post(url, json={"worker": "w"}).json()["error"]["code"] == "NO_PENDING_WORK"
    run_action(admin_client, listing, "reset_to_start", found.group(1))
    assert acked(client, sub) == {f"{prefix}/e/one": ZERO}
    assert client.post(url, json={"worker": "w"}).status_code == 200

    kid = client.get(f"{CONTROL}/jwks.json").json()["keys"][0]["kid"]  # made on first use
    keys = admin_client.get("/admin/subscriptions/webhookkey/")
    assert keys.status_code == 200 and kid in keys.text


def test_rotation_publishes_first_then_signs(client: httpx.Client, database_url: str) -> None:
    """A rotated key is in the JWKS at once and signs only from its activation; the old key
    stays published meanwhile. Webhooks keep verifying against the JWKS throughout."""
    receiver = Receiver(lambda received: (200, {"done": True}))
    try:
        prefix = f"rot{time.time_ns()}"
        sub = f"{prefix}-sub"
        created = put_subscription(
            client, sub, type="webhook", pattern=f"{prefix}/*", webhook={"url": receiver.url}
        )
        old_kid = created.json()["webhook"]["signing"]["kid"]

        later = manage(database_url, "rotate_webhook_key", "--activate-in", "3600")
        assert later.returncode == 0, later.stderr
        pending_kid = later.stdout.split()[0]
        kids = {k["kid"] for k in client.get(f"{CONTROL}/jwks.json").json()["keys"]}
        assert {old_kid, pending_kid} <= kids

        now = manage(database_url, "rotate_webhook_key", "--activate-in", "0")
        assert now.returncode == 0, now.stderr
        new_kid = now.stdout.split()[0]
        jwks = client.get(f"{CONTROL}/jwks.json").json()
        assert {old_kid, pending_kid, new_kid} <= {k["kid"] for k in jwks["keys"]}

        def signed_with_new_key() -> bool:
            count = len(receiver.received)
            client.post(f"/v1/stream/{prefix}/s", content=b"x",
                        headers={"Content-Type": "text/plain"})  # fmt: skip
            got = receiver.wait(count + 1)[-1]
            assert verify_signature(got, jwks)
            return f"kid={new_kid}," in (got.signature or "")

        client.put(f"/v1/stream/{prefix}/s", headers={"Content-Type": "text/plain"})
        wait_until(signed_with_new_key, timeout=60, interval=0.5)

        # Each server process keeps its key KEY_CACHE_SECONDS: the one answering this GET may
        # not be the one that sent the webhook above, and may still show the old key a while.
        def shown_kid() -> str:
            view = client.get(f"{CONTROL}/subscriptions/{sub}").json()
            return str(view["webhook"]["signing"]["kid"])

        wait_until(lambda: shown_kid() == new_kid, timeout=3 * KEY_CACHE_SECONDS, interval=0.2)
        pruned = manage(database_url, "rotate_webhook_key", "--prune")
        assert pruned.returncode == 0 and pruned.stdout.startswith("pruned 0 key(s)")
    finally:
        receiver.close()
