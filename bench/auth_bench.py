"""What checking credentials costs a request, in this process (no HTTP): the first request with
a key (one database query and one hash verification), every later one (dictionary lookups),
and the grant check that follows. For the whole request path with keys required against open
mode, side by side, see ``bench/compare.py --auth keys --versus DS_AUTH__MODE=open``.

Usage: .venv/bin/python bench/auth_bench.py [--iterations N]
(on the project's database, or DATABASE_URL's; creates one key and deletes it at the end)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "durable_project.settings")
os.environ["DS_AUTH__MODE"] = "keys"

import django

django.setup()

from access import auth  # noqa: E402
from access.grants import Grant, Operation, stream_resource  # noqa: E402
from access.models import ApiKey  # noqa: E402
from access.services import create_key  # noqa: E402
from streams.store import pool  # noqa: E402


def per_call_us(seconds: float, calls: int) -> float:
    return seconds / calls * 1e6


async def measure(header: str, iterations: int) -> dict[str, float]:
    resource = stream_resource("bench/auth/stream")
    figures: dict[str, float] = {}
    cold = []
    for _ in range(5):  # the first request of a process: a query and a hash verification
        auth.forget()
        auth._matched.clear()
        started = time.perf_counter()
        await auth.authenticate(header, {})
        cold.append(time.perf_counter() - started)
    figures["first request with a key (query + hash)"] = statistics.median(cold) * 1e6
    started = time.perf_counter()
    for _ in range(iterations):
        await auth.authenticate(header, {})
    figures["later requests: authenticate"] = per_call_us(time.perf_counter() - started, iterations)
    principal = await auth.authenticate(header, {})
    started = time.perf_counter()
    for _ in range(iterations):
        principal.require(resource, Operation.APPEND)
    figures["grant check (require)"] = per_call_us(time.perf_counter() - started, iterations)
    started = time.perf_counter()
    for _ in range(iterations):
        await auth.authenticate(None, {})
    figures["no credentials (anonymous)"] = per_call_us(time.perf_counter() - started, iterations)
    await pool.close_pool()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100_000)
    args = parser.parse_args()
    key, plaintext = create_key(name="auth-bench", grants=[Grant.parse("stream/bench/:append")])
    try:
        figures = asyncio.run(measure(f"Bearer {plaintext}", args.iterations))
    finally:
        ApiKey.objects.filter(pk=key.pk).delete()
    for label, value in figures.items():
        print(f"{label:45s} {value:10.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
