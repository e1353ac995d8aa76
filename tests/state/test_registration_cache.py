"""Each process keeps the registrations (compiled schemas) of the state streams it validates
appends to, at most DS_STATE__CACHED_REGISTRATIONS of them (state/validation.py): a soak probe
saw every deleted state stream's schemas kept for good, 75 KB each. Dropped ones are read
again when needed, and appends are judged by the right schemas throughout."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.state.support import append, append_ok, change, create_json_stream, register_ok

LIMIT = 3


@pytest.fixture(scope="module")
def small_cache(start_server: object) -> Iterator[httpx.Client]:
    server: ServerProcess = start_server(  # type: ignore[operator]
        env={"DS_STATE__CACHED_REGISTRATIONS": str(LIMIT)}
    )
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        yield http


def cached(client: httpx.Client) -> float:
    metrics = client.get("/metrics").text
    found = re.search(r"^ds_state_cached_registrations (\S+)$", metrics, re.MULTILINE)
    assert found is not None, "no ds_state_cached_registrations gauge"
    return float(found.group(1))


def test_registrations_kept_are_bounded_and_appends_judged_right(
    small_cache: httpx.Client, stream_path: str
) -> None:
    paths = [f"{stream_path}/{i}" for i in range(2 * LIMIT)]
    for i, path in enumerate(paths):
        create_json_stream(small_cache, path)
        register_ok(small_cache, path, {"t": {"type": "object", "required": [f"p{i}"]}})
    for _ in range(2):  # the second pass finds each one dropped since
        for i, path in enumerate(paths):
            refused = append(small_cache, path, [change("t", "k", {"other": 1})])
            assert refused.status_code == 400 and f'"p{i}" is a required' in refused.text
            append_ok(small_cache, path, [change("t", "k", {f"p{i}": 1})])
            assert cached(small_cache) <= LIMIT
    for path in paths:
        assert small_cache.delete(f"/v1/stream/{path}").status_code == 204
    assert cached(small_cache) <= LIMIT
