"""Prometheus metrics of the server (``/metrics``, the official ``prometheus-client``).

Each worker process counts in its own memory (``_Family``: an increment is one addition; the
registry, the text format and the scrape are prometheus-client's) and, every ``FLUSH_SECS``
and at shutdown, writes a snapshot of its samples to a directory shared by the workers of one
server (set up by ``durable_project.process``: ``DS_METRICS__DIR``). A scrape of ``/metrics``,
answered by any worker, sums the snapshots of all of them (gauges: of live workers only) and
renders them in the Prometheus text format. prometheus-client's own multiprocess mode was
measured first: it writes every increment to a memory-mapped file and checks the process id
each time, about a tenth of a worker's CPU under appends; this costs well under a microsecond
per update, and figures reach the scrape within ``FLUSH_SECS``.

Labels are bounded: a route family, a method, a status code, an outcome; never a stream path
or a key. With ``DS_METRICS__ENABLED=false`` every metric is a no-op.
"""

from __future__ import annotations

import json
import math
import os
import threading
from bisect import bisect_left
from pathlib import Path
from typing import Any

from django.conf import settings

# How often a worker writes its snapshot (seconds).
FLUSH_SECS = 1.0
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


class _Child:
    """The figures of one metric for one set of label values.

    Updated without a lock: every update is a single ``+=`` (or ``=``) of a number, which
    CPython runs without switching threads in between, and nearly all of them happen on the
    event loop's thread anyway. prometheus-client's own metrics take a lock and walk the
    buckets in Python at every observation: 27 us of a worker's CPU per append here
    (docs/benchmarks.md), for seven updates."""

    __slots__ = ("counts", "total", "value")

    def __init__(self, buckets: int) -> None:
        self.value = 0.0
        # Histograms: one count per bucket and +Inf (not cumulative), and the sum.
        self.counts = [0] * buckets
        self.total = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _HistogramChild(_Child):
    __slots__ = ("bounds",)

    def __init__(self, bounds: tuple[float, ...]) -> None:
        super().__init__(len(bounds) + 1)
        self.bounds = bounds

    def observe(self, value: float) -> None:
        # The first bucket whose upper bound is >= value (Prometheus buckets are "le").
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class _Family:
    """A metric (counter, gauge or histogram), and a collector of prometheus-client's registry.
    Without labels it is its own only child (``inc``, ``set``, ``observe``); with them,
    ``labels(*values)`` gives the child of those values, in the order the labels were
    declared."""

    def __init__(
        self, kind: str, name: str, documentation: str, labelnames: tuple[str, ...],
        buckets: tuple[float, ...] = (),
    ) -> None:  # fmt: skip
        self.kind, self.name, self.documentation = kind, name, documentation
        self.labelnames = labelnames
        self.bounds = tuple(float(bound) for bound in buckets)
        self._children: dict[tuple[str, ...], _Child] = {}
        if not labelnames:
            only = self.labels()
            self.inc, self.dec, self.set = only.inc, only.dec, only.set
            if isinstance(only, _HistogramChild):
                self.observe = only.observe

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, given {values}")
            child = _HistogramChild(self.bounds) if self.kind == "histogram" else _Child(0)
            self._children[values] = child
        return child

    def collect(self) -> Any:
        from prometheus_client.metrics_core import Metric
        from prometheus_client.utils import floatToGoString

        metric = Metric(self.name, self.documentation, self.kind)
        for values, child in list(self._children.items()):
            labels = dict(zip(self.labelnames, values, strict=True))
            if self.kind == "counter":
                metric.add_sample(f"{self.name}_total", labels, child.value)
            elif self.kind == "gauge":
                metric.add_sample(self.name, labels, child.value)
            else:
                cumulative = 0
                for bound, count in zip((*self.bounds, math.inf), list(child.counts), strict=True):
                    cumulative += count
                    le = {**labels, "le": floatToGoString(bound)}
                    metric.add_sample(f"{self.name}_bucket", le, cumulative)
                metric.add_sample(f"{self.name}_count", labels, cumulative)
                metric.add_sample(f"{self.name}_sum", labels, child.total)
        yield metric


_registry: Any = None


def registry() -> Any:
    global _registry
    if _registry is None:
        from prometheus_client import CollectorRegistry

        _registry = CollectorRegistry(auto_describe=True)
    return _registry


def _metric(
    kind: str, name: str, documentation: str, labels: tuple[str, ...] = (), **kw: Any
) -> Any:
    if not _enabled():
        return _Null()
    family = _Family(kind, name, documentation, labels, kw.get("buckets", ()))
    registry().register(family)
    return family


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
HELD_ANSWER_BYTES = _metric(
    "gauge", "ds_held_answer_bytes", "Bytes of answers being sent, held until clients take them"
)
ARRIVING_BODY_BYTES = _metric(
    "gauge", "ds_arriving_body_bytes", "Bytes of request bodies held while they arrive"
)
LIVE_READERS = _metric("gauge", "ds_live_readers", "Live readers waiting or streaming", ("mode",))
LIVE_REFUSALS = _metric(
    "counter", "ds_live_refusals",
    "Live reads refused, by the limit they met (client: 429, process: 503)", ("limit",),
)  # fmt: skip
NOTIFY_LAG = _metric(
    "histogram", "ds_notify_lag_seconds",
    "Time from an append's commit to its NOTIFY reaching this process", buckets=LATENCY_BUCKETS,
)  # fmt: skip
LISTEN_RECONNECTS = _metric(
    "counter", "ds_listen_reconnects", "LISTEN connections replaced", ("reason",)
)
WATCHED_STREAMS = _metric(
    "gauge", "ds_watched_streams", "Streams this process has live readers of (marked watched)"
)
WATCH_MARKS = _metric(
    "counter", "ds_watch_marks",
    "Statements marking streams watched, by why (subscribe, renew, reconnect) and outcome",
    ("reason", "outcome"),
)  # fmt: skip

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
POOL_DISCARDED = _metric(
    "counter", "ds_db_pool_oversized_closed",
    "Connections closed after carrying a large statement or result (their buffers freed)",
)  # fmt: skip

# -- background work --------------------------------------------------------------------------
EXPIRY_SWEEPS = _metric("counter", "ds_expiry_sweeps", "Sweeps for expired streams")
EXPIRED_STREAMS = _metric("counter", "ds_expired_streams", "Expired streams reclaimed by sweeps")
RETENTION_TRIMS = _metric(
    "counter", "ds_retention_trims", "Streams trimmed by the retention sweep for their policy"
)
PURGED_MESSAGES = _metric(
    "counter", "ds_purged_messages", "Messages deleted after trims (retention, explicit trims)"
)
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
STATE_CHECK_TIMEOUTS = _metric(
    "counter", "ds_state_check_timeouts",
    "Schema checks of appends that overran their deadline (their process was replaced)",
)  # fmt: skip
STATE_CACHED_REGISTRATIONS = _metric(
    "gauge", "ds_state_cached_registrations",
    "State stream registrations (compiled schemas) this process keeps for validating appends",
)  # fmt: skip


# -- subscriptions (subscriptions/) -----------------------------------------------------------
SUB_WEBHOOKS = _metric(
    "counter", "ds_subscription_webhooks",
    "Webhook requests sent, by outcome: done (auto-acked), accepted (callback to come), failed",
    ("outcome",),
)  # fmt: skip
SUB_WEBHOOK_SECONDS = _metric(
    "histogram", "ds_subscription_webhook_duration_seconds",
    "Time for a webhook receiver to answer", buckets=LATENCY_BUCKETS,
)  # fmt: skip
SUB_WAKE_SECONDS = _metric(
    "histogram", "ds_subscription_wake_seconds",
    "Time from this process hearing of an append to the webhook request it causes",
    buckets=LATENCY_BUCKETS,
)  # fmt: skip
SUB_REQUESTS = _metric(
    "counter", "ds_subscription_wake_requests",
    "Callbacks, claims, acks and releases, by kind and outcome", ("kind", "outcome"),
)  # fmt: skip
SUB_EXPIRED = _metric(
    "counter", "ds_subscription_expired_wakes",
    "Wakes ended because their lease expired or the process sending them stopped",
)  # fmt: skip


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


# -- snapshots shared by the workers ---------------------------------------------------------


def _directory() -> Path | None:
    directory = os.environ.get("DS_METRICS__DIR")
    return Path(directory) if directory and _enabled() else None


_flush_lock = threading.Lock()


def flush() -> None:
    """Write this worker's samples where the scrape finds them (atomically: a reader never
    sees half a file). Threads of one worker flush one at a time: the periodic flush, a scrape
    and the console's sampler would otherwise share the temporary file (one renames it away
    from the other)."""
    directory = _directory()
    if directory is None:
        return
    with _flush_lock:
        _write_snapshot(directory)


def _write_snapshot(directory: Path) -> None:
    families = []
    for family in registry().collect():
        samples = [
            [sample.name, sample.labels, sample.value]
            for sample in family.samples
            if not sample.name.endswith("_created")
        ]
        families.append([family.name, family.type, family.documentation, samples])
    target = directory / f"{os.getpid()}.json"
    temporary = directory / f".{os.getpid()}.json.tmp"
    temporary.write_text(json.dumps(families))
    temporary.replace(target)


def exposition() -> tuple[bytes, str]:
    """The metrics of every worker of this server, in the Prometheus text format."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    flush()
    return generate_latest(_Merged(_snapshots())), CONTENT_TYPE_LATEST


Labels = tuple[tuple[str, str], ...]


def totals(names: frozenset[str]) -> dict[tuple[str, Labels], float]:
    """The samples named ``names``, summed over every worker as a scrape sums them (gauges of
    live workers only), by sample name and sorted labels: for pages that show a few figures
    (the console's overview) without rendering the whole exposition."""
    summed: dict[tuple[str, Labels], float] = {}
    for alive, families in _snapshots():
        for _name, kind, _documentation, samples in families:
            if kind == "gauge" and not alive:
                continue
            for sample_name, labels, value in samples:
                if sample_name in names:
                    key = (sample_name, tuple(sorted(labels.items())))
                    summed[key] = summed.get(key, 0.0) + value
    return summed


def _snapshots() -> list[tuple[bool, list[Any]]]:
    """(is the worker alive, its families) for every snapshot of this server."""
    directory = _directory()
    if directory is None:
        return [(True, _families_of_this_process())]
    snapshots = []
    for path in directory.glob("*.json"):
        try:
            families = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced or removed meanwhile
        snapshots.append((_alive(int(path.stem)), families))
    return snapshots


def _families_of_this_process() -> list[Any]:
    return [
        [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples
                                            if not s.name.endswith("_created")]]
        for f in registry().collect()
    ]  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Merged:
    """A collector of the workers' snapshots summed: counters and histograms of every worker
    (a dead worker's counts still happened), gauges of live workers only."""

    def __init__(self, snapshots: list[tuple[bool, list[Any]]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Any:
        from prometheus_client.metrics_core import Metric

        merged: dict[str, Metric] = {}
        sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for alive, families in self._snapshots:
            for name, kind, documentation, samples in families:
                if kind == "gauge" and not alive:
                    continue
                if name not in merged:
                    merged[name] = Metric(name, documentation, kind)
                    sums[name] = {}
                for sample_name, labels, value in samples:
                    key = (sample_name, tuple(sorted(labels.items())))
                    sums[name][key] = sums[name].get(key, 0.0) + value
        for name, metric in merged.items():
            for (sample_name, labels), value in sorted(sums[name].items()):
                metric.add_sample(sample_name, dict(labels), value)
            yield metric


def forget_process() -> None:
    """At shutdown: this worker's last counts are written; its gauges stop counting (a dead
    worker's gauges are left out of the sum)."""
    flush()
