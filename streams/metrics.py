"""Prometheus metrics of the server (``/metrics``, the official ``prometheus-client``).

Every uvicorn worker counts in files of a directory shared by the workers of one server
(prometheus-client's multiprocess mode), and a scrape of ``/metrics``, answered by whichever
worker, sums them all. The directory is ``PROMETHEUS_MULTIPROC_DIR`` when set; otherwise one
of the server's own under the temporary directory, named after the server (the uvicorn
supervisor when there are workers), set by ``durable_project.asgi`` before anything imports
prometheus-client. Management commands count in memory and export nothing.

Labels are bounded: a route family, a method, a status code, an outcome; never a stream path
or a key. With ``DS_METRICS__ENABLED=false`` every metric is a no-op.
"""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings

# Sub-millisecond buckets first: a durable append takes ~0.2-2 ms.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"})


def _enabled() -> bool:
    return bool(getattr(settings, "DS_METRICS_ENABLED", True))


class _Null:
    """What a metric is when metrics are off: every operation does nothing."""

    def labels(self, *args: Any, **kwargs: Any) -> _Null:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


def _metric(
    kind: str, name: str, documentation: str, labels: tuple[str, ...] = (), **kw: Any
) -> Any:
    if not _enabled():
        return _Null()
    import prometheus_client

    if kind == "gauge" and "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        kw.setdefault("multiprocess_mode", "livesum")
    cls = {"counter": prometheus_client.Counter, "gauge": prometheus_client.Gauge,
           "histogram": prometheus_client.Histogram}[kind]  # fmt: skip
    return cls(name, documentation, labels, **kw)


# -- requests ---------------------------------------------------------------------------------
REQUESTS = _metric(
    "counter", "ds_http_requests", "HTTP requests answered", ("route", "method", "status")
)
REQUEST_SECONDS = _metric(
    "histogram", "ds_http_request_duration_seconds",
    "Time to answer a request (to the end of the response; live reads excluded)",
    ("route", "method"), buckets=LATENCY_BUCKETS,
)  # fmt: skip

# -- appends ----------------------------------------------------------------------------------
APPENDS = _metric("counter", "ds_appends", "Append requests by outcome", ("outcome",))
APPEND_BYTES = _metric("counter", "ds_append_bytes", "Bytes of data stored by appends")
APPEND_SECONDS = _metric(
    "histogram", "ds_append_duration_seconds",
    "Time from an append entering group commit to its commit", buckets=LATENCY_BUCKETS,
)  # fmt: skip
BATCH_REQUESTS = _metric(
    "histogram", "ds_group_commit_batch_requests", "Requests per group-commit transaction",
    buckets=COUNT_BUCKETS,
)  # fmt: skip

# -- reads ------------------------------------------------------------------------------------
CATCH_UP_BYTES = _metric("counter", "ds_catch_up_bytes", "Bytes of messages sent by catch-up reads")
LIVE_READERS = _metric("gauge", "ds_live_readers", "Live readers waiting or streaming", ("mode",))
NOTIFY_LAG = _metric(
    "histogram", "ds_notify_lag_seconds",
    "Time from an append's commit to its NOTIFY reaching this process", buckets=LATENCY_BUCKETS,
)  # fmt: skip
LISTEN_RECONNECTS = _metric(
    "counter", "ds_listen_reconnects", "LISTEN connections replaced", ("reason",)
)

# -- database pool ----------------------------------------------------------------------------
POOL_CONNECTIONS = _metric(
    "gauge", "ds_db_pool_connections", "Connections of the async pool", ("state",)
)
POOL_WAITS = _metric("counter", "ds_db_pool_waits", "Borrowings that had to wait for a connection")
POOL_WAIT_SECONDS = _metric(
    "histogram", "ds_db_pool_wait_seconds", "Time waited for a pooled connection",
    buckets=LATENCY_BUCKETS,
)  # fmt: skip
POOL_TIMEOUTS = _metric("counter", "ds_db_pool_timeouts", "Borrowings that timed out (503)")

# -- background work --------------------------------------------------------------------------
EXPIRY_SWEEPS = _metric("counter", "ds_expiry_sweeps", "Sweeps for expired streams")
EXPIRED_STREAMS = _metric("counter", "ds_expired_streams", "Expired streams reclaimed by sweeps")
YJS_COMPACTIONS = _metric(
    "counter", "ds_yjs_compactions", "Yjs compactions by outcome", ("outcome",)
)
YJS_COMPACTION_SECONDS = _metric(
    "histogram", "ds_yjs_compaction_duration_seconds", "Time of a Yjs compaction",
    buckets=LATENCY_BUCKETS,
)  # fmt: skip
YJS_COMPACTION_BYTES = _metric(
    "counter", "ds_yjs_compaction_bytes", "Bytes merged (updates) and written (snapshots)",
    ("kind",),
)  # fmt: skip
STATE_LAG = _metric(
    "histogram", "ds_state_materialization_lag_seconds",
    "Time from an append to a state stream until its entities reflect it",
    buckets=LATENCY_BUCKETS,
)  # fmt: skip


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


def exposition() -> tuple[bytes, str]:
    """The metrics of every worker of this server, in the Prometheus text format."""
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        CollectorRegistry,
        generate_latest,
        multiprocess,
    )

    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def forget_process() -> None:
    """At shutdown: this worker's live gauges stop counting."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ and _enabled():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())
