"""Unit tests of the in-memory part of live delivery (``streams.live.LiveHub``): which kept
data a woken reader may take instead of re-reading. No database: a watched stream is one with
a subscriber registered."""

from __future__ import annotations

import asyncio
import base64

import pytest

from streams.live import Appended, LiveHub, Subscription
from streams.protocol.offsets import Offset


def _watched_hub(stream_id: int = 7) -> tuple[LiveHub, Subscription]:
    hub = LiveHub()
    subscription = Subscription()
    hub._subscriptions[stream_id] = {subscription}
    return hub, subscription


def _payload(stream_id: int, first: Offset, messages: list[bytes], state: str = "o") -> str:
    data = b"".join(messages)
    lengths = ",".join(str(len(m)) for m in messages)
    head = f"{stream_id}:{first.seq + len(messages)}:{state}"
    return f"{head}:{first.seq}:{first.pos}:{lengths}:{base64.b64encode(data).decode()}"


def test_notified_data_is_delivered_from_the_readers_offset() -> None:
    hub, subscription = _watched_hub()
    hub._on_notify(_payload(7, Offset(0, 0), [b"ab", b"c"]))
    hub._on_notify(_payload(7, Offset(2, 3), [b"de:f"]))
    assert subscription._event.is_set()

    delivery = hub.local_delivery(7, Offset(0, 0), 1 << 20, 1000)
    assert delivery is not None
    assert delivery.messages == [b"ab", b"c", b"de:f"]
    assert delivery.end == Offset(3, 7)
    assert delivery.up_to_date and not delivery.closed
    # A reader in the middle of a kept append has no exact start: it re-reads.
    assert hub.local_delivery(7, Offset(1, 2), 1 << 20, 1000) is None


def test_the_same_append_from_a_local_commit_and_its_notification_is_kept_once() -> None:
    hub, _ = _watched_hub()
    entry = Appended(Offset(0, 0), Offset(1, 2), (b"ab",), False)
    hub._on_notify(_payload(7, Offset(0, 0), [b"ab"]))
    hub.publish(7, 1, False, [entry])
    delivery = hub.local_delivery(7, Offset(0, 0), 1 << 20, 1000)
    assert delivery is not None and delivery.messages == [b"ab"]


def test_a_gap_ends_what_memory_can_deliver_and_the_reader_is_not_up_to_date() -> None:
    hub, _ = _watched_hub()
    hub.publish(7, 1, False, [Appended(Offset(0, 0), Offset(1, 1), (b"a",), False)])
    # Another process appended seq 1 with data too large to carry; then this process seq 2.
    hub._on_notify("7:2:o")
    hub.publish(7, 3, False, [Appended(Offset(2, 9), Offset(3, 10), (b"c",), False)])
    delivery = hub.local_delivery(7, Offset(0, 0), 1 << 20, 1000)
    assert delivery is not None and delivery.messages == [b"a"]
    assert not delivery.up_to_date
    assert hub.local_delivery(7, Offset(1, 1), 1 << 20, 1000) is None


def test_a_lost_listen_connection_forgets_kept_data() -> None:
    hub, _ = _watched_hub()
    hub.publish(7, 1, False, [Appended(Offset(0, 0), Offset(1, 1), (b"a",), False)])
    hub._wake_all()
    assert hub.local_delivery(7, Offset(0, 0), 1 << 20, 1000) is None


@pytest.mark.parametrize(
    "payload",
    [
        "",
        "7",
        "x:1:o",
        "7:1:o:0:0:5:YWJj",  # lengths do not match the data
        "7:1:o:0:0:3:not base64!",
        "7:1:o:zero:0:3:YWJj",
    ],
)
def test_malformed_notifications_never_raise(payload: str) -> None:
    hub, _ = _watched_hub()
    hub._on_notify(payload)
    assert hub.local_delivery(7, Offset(0, 0), 1 << 20, 1000) is None


def test_the_renewal_of_watch_marks_restarts_when_a_reader_subscribes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without renewals the marks of a process's streams run out, and other processes'
    appends stop reaching its readers: a renewal task that stopped is started again by the
    next subscription (the LISTEN connection and the marks' writes replaced by stand-ins)."""
    hub = LiveHub()
    marked: list[list[int]] = []

    async def listen() -> None:
        hub._listening.set()
        await asyncio.Event().wait()

    async def mark(stream_ids: list[int], reason: str) -> None:
        marked.append(stream_ids)

    monkeypatch.setattr(hub, "_listen", listen)
    monkeypatch.setattr(hub, "_mark", mark)

    async def scenario() -> None:
        async with hub.subscribe(7):
            first = hub._renewer
            assert first is not None and not first.done()
            first.cancel()
            await asyncio.sleep(0)
        async with hub.subscribe(8):
            assert hub._renewer is not first and not hub._renewer.done()
        await hub.stop()

    asyncio.run(scenario())
    assert marked == [[7], [8]]


def test_what_is_kept_is_bounded_per_stream_and_per_process() -> None:
    """Probe 9a: 64 appends of up to 256 KiB were kept per watched stream, 16 MiB each, for as
    many streams as a client watched (10 streams: 161 MiB more per worker). A stream keeps at
    most 1 MiB of its newest appends, the process 64 MiB in all; past that a stream keeps
    nothing (its readers re-read), and what is kept is always the newest, contiguous."""
    hub = LiveHub()
    streams = range(100)
    for stream_id in streams:
        hub._subscriptions[stream_id] = {Subscription()}
    block = b"x" * (200 * 1024)
    for seq in range(10):
        start, end = Offset(seq, seq * len(block)), Offset(seq + 1, (seq + 1) * len(block))
        for stream_id in streams:
            hub.publish(stream_id, seq + 1, False, [Appended(start, end, (block,), False)])
    assert hub._recent.size <= 64 * 1024 * 1024
    kept = [hub._recent.get(stream_id) for stream_id in streams]
    assert sum(1 for entries in kept if entries) >= 64 * 1024 // 1024 - 1
    for stream_id, entries in zip(streams, kept, strict=True):
        if not entries:
            assert hub.local_delivery(stream_id, Offset(9, 9 * len(block)), 1 << 30, 1000) is None
            continue
        assert sum(e.end.pos - e.start.pos for e in entries) <= 1024 * 1024
        assert entries[-1].end == Offset(10, 10 * len(block))
        first = entries[0].start
        delivery = hub.local_delivery(stream_id, first, 1 << 30, 1000)
        assert delivery is not None and delivery.end == Offset(10, 10 * len(block))
    hub._recent.forget(0)
    hub._recent.clear()
    assert hub._recent.size == 0


def test_a_message_counts_more_than_its_bytes() -> None:
    """Review: kept appends were counted by their data alone, so 100,000 two-byte JSON messages
    (200 KB, under the largest append kept) were kept as 4-5 MB of objects. Each message counts
    its object too: such an append is not kept, and its readers re-read."""
    hub, _ = _watched_hub()
    messages = (b"10",) * 100_000
    hub.publish(
        7, 100_000, False, [Appended(Offset(0, 0), Offset(100_000, 200_000), messages, False)]
    )
    assert hub._recent.get(7) is None and hub._recent.size == 0
    assert hub.local_delivery(7, Offset(0, 0), 1 << 30, 1 << 30) is None
