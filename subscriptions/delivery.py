"""Wakes and webhook delivery inside every server process (PROTOCOL.md 7).

Nothing here is the state of a subscription: that is in PostgreSQL, and this module only
moves it along, so any process can stop at any moment and another carries on.

* An append to a followed stream NOTIFYs ``sub:<subscription ids>`` (``sql/subscriptions.sql``)
  on the live-delivery channel; every process hears it and asks ``ds_sub_wake`` to issue a
  wake. The subscription's row lock lets exactly one of them issue it; for a webhook, that one
  process sends the request (one request per wake), then records its outcome.
  Past 200 subscriptions the NOTIFY names the stream (``sub:@<stream id>``), and the process
  looks up its subscriptions.
* A sweep every ``DS_SUBSCRIPTIONS__SWEEP_INTERVAL_SECS`` ends wakes whose lease expired or
  whose sending process stopped, and wakes idle subscriptions with pending work: retries that
  fell due (their schedule is in the row, so a restart honours it), and anything a lost
  notification left behind, found a step at a time (``DS_SUBSCRIPTIONS__SWEEP_LINKS`` links
  a sweep, going round every subscription in turn: its work does not grow with how many
  links there are). A process starting, or whose LISTEN connection reconnects, looks at every
  subscription at once.
* Each webhook request is a new wake (its own generation, wake id and callback token), signed
  with the server's Ed25519 key (``subscriptions.keys``), sent with aiohttp through a resolver
  that refuses forbidden addresses (``subscriptions.ssrf``), without following redirects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from typing import Any
from urllib.parse import quote

import aiohttp
from django.conf import settings

from streams import metrics
from streams.errors import ServiceUnavailable
from streams.store.failures import log_failure
from subscriptions import keys, signing, store
from subscriptions.ssrf import SafeResolver, check_url

logger = logging.getLogger(__name__)

# Bytes of a webhook's answer read to find {"done": true}; a longer answer is not read further.
MAX_ANSWER_BYTES = 64 * 1024
# Sids heard of and not yet handled (more means "check them all", as after a lost connection).
MAX_HEARD = 10_000

# How long stopping waits to hand back the wakes it was sending (seconds).
RELEASE_TIMEOUT_SECS = 2.0
# This process, as the sender of the webhook requests it issues (ds_subscription.sender).
SENDER = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"

_heard: dict[int, float] = {}  # sid -> when first heard (monotonic), for ds_subscription_wake
_heard_streams: set[int] = set()  # streams with more subscriptions than a NOTIFY names
_cursor: tuple[int, str] = (0, "")  # where the sweep's next step looks (ds_sub_sweep_step)
_check_all = False
_poke: asyncio.Event | None = None
_tasks: set[asyncio.Task[Any]] = set()
_waker: asyncio.Task[None] | None = None
_sweeper: asyncio.Task[None] | None = None
_session: aiohttp.ClientSession | None = None
_slots: asyncio.Semaphore | None = None


def listen_for_wakes() -> None:
    """Hear of appends to followed streams on this process's LISTEN connection."""
    from streams.live import hub

    hub.add_handler("sub", _on_notify)
    hub.add_reconnect_hook(check_all)


def _on_notify(payload: str) -> None:
    global _check_all
    if payload == "*" or len(_heard) + len(_heard_streams) >= MAX_HEARD:
        _check_all = True
    elif payload.startswith("@"):
        with contextlib.suppress(ValueError):
            _heard_streams.add(int(payload[1:]))
    else:
        now = time.monotonic()
        for part in payload.split(","):
            with contextlib.suppress(ValueError):
                _heard.setdefault(int(part), now)
    _wake_up()


def check_all() -> None:
    """Wake every subscription with pending work (notifications may have been missed)."""
    global _check_all
    _check_all = True
    _wake_up()


def _wake_up() -> None:
    if _poke is not None:
        _poke.set()


def ensure_started() -> None:
    """Start the waker and the sweep (idempotent; in the event loop)."""
    global _waker, _sweeper, _poke, _slots
    loop = asyncio.get_running_loop()
    if _poke is None:
        _poke = asyncio.Event()
        _slots = asyncio.Semaphore(settings.DS_SUBSCRIPTIONS_MAX_CONCURRENT_DELIVERIES)
    if _waker is None or _waker.done():
        _waker = loop.create_task(_wake_loop(), name="ds-subscription-waker")
        check_all()
    interval = settings.DS_SUBSCRIPTIONS_SWEEP_INTERVAL_SECS
    if interval > 0 and (_sweeper is None or _sweeper.done()):
        _sweeper = loop.create_task(_sweep_loop(interval), name="ds-subscription-sweep")


async def stop() -> None:
    """Stop waking and sending. The wakes this process was still sending are handed back:
    their deadline is now, so the next sweep of any process (this one restarted, or another)
    sends them again, rather than when the webhook's timeout would have ended them (probe
    10f: with a 600 s timeout, wakes cut by a restart waited ten minutes)."""
    global _session
    sending = [task for task in _tasks if not task.done()]
    for task in (_waker, _sweeper, *_tasks):
        if task is not None:
            task.cancel()
    if sending:
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_SECS):
                await store.release_sending(SENDER)
        except Exception as exc:  # noqa: BLE001 - they end at their deadline anyway
            log_failure(logger, "handing back webhook wakes", exc)
    if _session is not None:
        session, _session = _session, None
        await session.close()


async def _wake_loop() -> None:
    global _check_all
    assert _poke is not None
    while True:
        await _poke.wait()
        _poke.clear()
        heard = dict(_heard)
        _heard.clear()
        streams = sorted(_heard_streams)
        _heard_streams.clear()
        everything, _check_all = _check_all, False
        try:
            sids = list(heard)
            if everything:
                sids = list(dict.fromkeys([*sids, *await store.candidates()]))
            elif streams:
                sids = list(dict.fromkeys([*sids, *await store.following(streams)]))
            if sids:
                for delivery in await store.wake(sorted(sids), SENDER):
                    _observe_wake(heard.get(delivery.sid))
                    send(delivery)
        except ServiceUnavailable:
            logger.warning("subscription wakes postponed: the database is unavailable")
            await asyncio.sleep(1)
            check_all()
        except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again
            log_failure(logger, "issuing subscription wakes", exc)
            await asyncio.sleep(1)
            check_all()


async def _sweep_loop(interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await sweep()
        except ServiceUnavailable:
            logger.warning("subscription sweep skipped: the database is unavailable")
        except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again
            log_failure(logger, "subscription sweep", exc)


async def sweep() -> None:
    """End wakes past their lease or sender, then wake what has pending work: retries due,
    and what the next step of the look for lost notifications finds."""
    global _cursor
    expired = await store.expire()
    if expired:
        metrics.SUB_EXPIRED.inc(len(expired))
    found, _cursor = await store.sweep_step(_cursor, settings.DS_SUBSCRIPTIONS_SWEEP_LINKS)
    sids = list(dict.fromkeys([*expired, *await store.due(), *found]))
    if sids:
        for delivery in await store.wake(sorted(sids), SENDER):
            send(delivery)


def _observe_wake(heard_at: float | None) -> None:
    if heard_at is not None:
        metrics.SUB_WAKE_SECONDS.observe(time.monotonic() - heard_at)


def send(delivery: store.Delivery) -> None:
    """Send a webhook wake this process issued, in the background."""
    task = asyncio.get_running_loop().create_task(_deliver(delivery), name="ds-webhook")
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


async def _deliver(delivery: store.Delivery) -> None:
    """Send the wake, record the outcome, and send the next wake that recording issued."""
    next_delivery: store.Delivery | None = delivery
    while next_delivery is not None:
        current = next_delivery
        assert _slots is not None
        async with _slots:
            done, error = await _post(current)
        try:
            next_delivery = await store.delivered(current, done=done, error=error, sender=SENDER)
        except Exception:  # the sweep ends the wake after its deadline and wakes again
            logger.exception("recording the outcome of webhook %s failed", current.wake_id)
            return


def webhook_body(delivery: store.Delivery) -> bytes:
    """The wake notification (PROTOCOL.md 7.1), with its callback URL and token."""
    callback = (
        f"{delivery.base_url}/v1/stream/__ds/subscriptions/"
        f"{quote(delivery.subscription_id, safe='')}/callback"
    )
    token = signing.issue_token(
        sid=delivery.sid,
        generation=delivery.generation,
        wake_id=delivery.wake_id,
        use=signing.CALLBACK,
    )
    body = {
        "subscription_id": delivery.subscription_id,
        "wake_id": delivery.wake_id,
        "generation": delivery.generation,
        "streams": delivery.streams,
        "callback_url": callback,
        "callback_token": token,
    }
    return json.dumps(body, separators=(",", ":")).encode()


async def _post(delivery: store.Delivery) -> tuple[bool, str | None]:
    """Send one webhook request: (done, None) on a 2xx answer, (False, why) on a failure."""
    started = time.perf_counter()
    result: tuple[bool, str | None]
    try:
        # Addresses written in the URL are checked here (aiohttp resolves only names).
        check_url(delivery.url, allow_loopback=settings.DS_SUBSCRIPTIONS_ALLOW_LOOPBACK_WEBHOOKS)
        body = webhook_body(delivery)
        key = await keys.signing_key()
        headers = {
            "Content-Type": "application/json",
            "Webhook-Signature": signing.signature_header(key, body),
            "User-Agent": "durable-streams-django",
        }
        timeout = aiohttp.ClientTimeout(total=settings.DS_SUBSCRIPTIONS_WEBHOOK_TIMEOUT_SECS)
        async with _client().post(
            delivery.url, data=body, headers=headers, allow_redirects=False, timeout=timeout
        ) as response:
            if not 200 <= response.status < 300:
                outcome, result = "failed", (False, f"the webhook answered {response.status}")
            else:
                done = _is_done(await response.content.read(MAX_ANSWER_BYTES))
                outcome, result = ("done" if done else "accepted"), (done, None)
    except TimeoutError:
        outcome, result = "failed", (False, "the webhook did not answer in time")
    except Exception as exc:  # noqa: BLE001 - any failure to deliver is a failed attempt
        outcome, result = "failed", (False, f"the webhook request failed: {_describe(exc)}")
    metrics.SUB_WEBHOOKS.labels(outcome).inc()
    metrics.SUB_WEBHOOK_SECONDS.observe(time.perf_counter() - started)
    return result


def _is_done(answer: bytes) -> bool:
    try:
        value = json.loads(answer)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and value.get("done") is True


def _describe(exc: BaseException) -> str:
    from subscriptions.protocol import SubscriptionError

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, SubscriptionError):
            return cause.message
        cause = cause.__cause__ or cause.__context__
    return (str(exc) or type(exc).__name__)[:300]


def _client() -> aiohttp.ClientSession:
    global _session
    if _session is None or _session.closed:
        connector = aiohttp.TCPConnector(
            resolver=SafeResolver(  # type: ignore[arg-type]
                allow_loopback=settings.DS_SUBSCRIPTIONS_ALLOW_LOOPBACK_WEBHOOKS
            ),
            limit=settings.DS_SUBSCRIPTIONS_MAX_CONCURRENT_DELIVERIES,
            ttl_dns_cache=None,
            use_dns_cache=False,
        )
        _session = aiohttp.ClientSession(connector=connector, trust_env=False)
    return _session
