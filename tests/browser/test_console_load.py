"""The stream page under load: 200 appends per second for CONSOLE_LOAD_SECONDS (30 by default;
``make test`` runs a shorter version, ``make test-browser-load`` the full one) while the page
follows the stream. Every message must arrive, and the page must still answer a click within
200 ms: here the time bound is the behaviour under test.

The click's latency is measured by the page itself, from the click event's time stamp (when the
browser received the input) to the next animation frame after its handler ran, the frame that
shows its effect. What the test process adds (Playwright's round trips, this machine's other
work) is reported beside it, not judged.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser.support import screenshot, wait_until
from tests.browser.test_console import messages, open_stream
from tests.conftest import ServerProcess
from tests.yjs.support import unique

RATE = 200
SECONDS = float(os.environ.get("CONSOLE_LOAD_SECONDS", "30"))
CLICK_BUDGET_MS = 200
WINDOW = 500  # static/console/js/stream.js keeps this many messages in the DOM

MEASURE_CLICKS = """
() => {
  window.__clickLatencies = [];
  document.addEventListener("click", (event) => {
    const received = event.timeStamp;
    requestAnimationFrame(() => window.__clickLatencies.push(performance.now() - received));
  }, true);
}
"""


@dataclass
class Load:
    """Appends ``{"n": i}`` at RATE per second from a thread of its own."""

    url: str
    headers: dict[str, str]
    total: int
    statuses: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(timeout=SECONDS + 60)
        assert not self.thread.is_alive(), "the load did not finish"

    async def _run(self) -> None:
        headers = self.headers | {"Content-Type": "application/json"}
        connector = aiohttp.TCPConnector(limit=32)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def post(n: int) -> None:
                async with session.post(self.url, data=json.dumps({"n": n}), headers=headers) as r:
                    self.statuses[r.status] = self.statuses.get(r.status, 0) + 1

            started = time.monotonic()
            tasks = []
            for n in range(self.total):
                delay = started + n / RATE - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(post(n)))
            await asyncio.gather(*tasks)
            self.seconds = time.monotonic() - started


def click_and_measure(page: Page, selector: str, status: str) -> tuple[float, float]:
    """Click like a person (a real input event at the button), and return the page's latency
    and what the test process saw until the status changed, both in ms."""
    box = page.locator(selector).bounding_box()
    assert box is not None
    before = page.evaluate("window.__clickLatencies.length")
    started = time.monotonic()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    expect(page.locator("#live-status")).to_have_attribute("data-status", status, timeout=5000)
    outside = (time.monotonic() - started) * 1000
    # (Not page.wait_for_function: its predicate is eval'd, which the page's CSP refuses.)
    wait_until(lambda: page.evaluate("window.__clickLatencies.length") > before, timeout=5)
    inside = page.evaluate(f"window.__clickLatencies[{before}]")
    return inside, outside


@pytest.mark.slow
def test_the_page_keeps_up_with_200_appends_per_second(
    page: Page, keys_server: ServerProcess, api: httpx.Client, ops_key: str
) -> None:
    path = unique("load")
    assert api.put(f"/v1/stream/{path}", headers={"Content-Type": "application/json"}).is_success
    open_stream(page, keys_server, path)
    page.evaluate(MEASURE_CLICKS)
    total = int(RATE * SECONDS)
    load = Load(keys_server.stream_url(path), {"Authorization": f"Bearer {ops_key}"}, total)
    load.start()
    started = time.monotonic()

    # Pause and resume twice while the appends go on: each click must be answered at once.
    clicks: list[tuple[float, float]] = []
    for at in (SECONDS / 3, 2 * SECONDS / 3):
        time.sleep(max(0.0, started + at - time.monotonic()))
        clicks.append(click_and_measure(page, "#pause", "paused"))
        time.sleep(1)
        clicks.append(click_and_measure(page, "#pause", "live"))
    load.join()
    assert load.statuses == {204: total}, load.statuses
    # The load itself kept its rate (a slower one would not test what it says).
    assert load.seconds < SECONDS * 1.2 + 1, f"{total} appends took {load.seconds:.1f}s"

    # Every message arrived, in the stream's order; the DOM holds only the newest window. (The
    # load's requests are concurrent, on several connections: the stream's order is the order
    # the server took them in, which their numbers need not follow.)
    stored = [m["n"] for m in api.get(f"/v1/stream/{path}", params={"offset": "-1"}).json()]
    assert sorted(stored) == list(range(total))
    expect(page.locator("#received-count")).to_have_text(str(total), timeout=30_000)
    shown = messages(page)
    expect(shown.last).to_contain_text(f'"n": {stored[-1]}')
    count = shown.count()
    assert count <= WINDOW
    numbers = [json.loads(text)["n"] for text in shown.locator("pre.body").all_inner_texts()]
    assert numbers == stored[-count:]
    tail = api.head(f"/v1/stream/{path}").headers["Stream-Next-Offset"]
    expect(page.locator("#tail-offset")).to_have_text(tail)

    # And the page still answers the next click at once.
    clicks.append(click_and_measure(page, "#pause", "paused"))
    screenshot(page, "stream-under-load")
    inside = [round(latency) for latency, _ in clicks]
    outside = [round(latency) for _, latency in clicks]
    print(
        f"\n{total} appends in {load.seconds:.1f}s ({total / load.seconds:.0f}/s); "
        f"click to next frame in the page: {inside} ms; click to status seen by the test: "
        f"{outside} ms"
    )
    assert max(inside) < CLICK_BUDGET_MS, f"click latencies {inside} ms"

    # The overview saw the load (its chart's last minutes).
    page.goto(f"{keys_server.base_url}/console/")
    expect(page.locator("#appends-chart canvas")).to_have_count(1)
    screenshot(page, "overview-after-load")
