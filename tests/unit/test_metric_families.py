"""The server's own metric objects (streams.metrics._Family) expose exactly what
prometheus-client's would for the same updates: same families, samples, labels and values,
histogram buckets included (a value equal to a bound counts in that bound's bucket)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from streams.metrics import COUNT_BUCKETS, LATENCY_BUCKETS, _Family

VALUES = st.one_of(
    st.sampled_from([*LATENCY_BUCKETS, *COUNT_BUCKETS, 0.0]),
    st.floats(min_value=0, max_value=1e4, allow_nan=False),
)
LABELS = st.sampled_from([("stream", "POST"), ("stream", "GET"), ("probe", "GET")])


def exposition(*collectors: Any) -> list[str]:
    """The text format's lines, but the ``_created`` samples (timestamps of creation, which
    the server leaves out of its snapshots)."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


@given(st.lists(st.tuples(LABELS, VALUES), max_size=60), st.sampled_from([LATENCY_BUCKETS,
       COUNT_BUCKETS]))  # fmt: skip
def test_a_histogram_with_labels_as_prometheus_client_has_it(
    observations: list[tuple[tuple[str, str], float]], buckets: tuple[float, ...]
) -> None:
    ours = _Family("histogram", "h_seconds", "doc", ("route", "method"), buckets)
    theirs = Histogram(
        "h_seconds", "doc", ("route", "method"), buckets=buckets, registry=None
    )  # fmt: skip
    for labels, value in observations:
        ours.labels(*labels).observe(value)
        theirs.labels(*labels).observe(value)
    assert exposition(ours) == exposition(theirs)


@given(st.lists(VALUES, max_size=30))
def test_counters_gauges_and_a_histogram_without_labels(values: list[float]) -> None:
    ours = [
        _Family("counter", "c", "doc", ()),
        _Family("counter", "cl", "doc", ("outcome",)),
        _Family("gauge", "g", "doc", ("state",)),
        _Family("histogram", "h", "doc", (), COUNT_BUCKETS),
    ]
    theirs = [
        Counter("c", "doc", registry=None),
        Counter("cl", "doc", ("outcome",), registry=None),
        Gauge("g", "doc", ("state",), registry=None),
        Histogram("h", "doc", buckets=COUNT_BUCKETS, registry=None),
    ]
    for value in values:
        for metrics in (ours, theirs):
            counter, labelled, gauge, histogram = metrics
            counter.inc(value)
            labelled.labels("appended" if value > 1 else "duplicate").inc()
            gauge.labels("open").set(value)
            gauge.labels("idle").inc(value)
            gauge.labels("idle").dec(1)
            histogram.observe(value)
    assert exposition(*ours) == exposition(*theirs)


def test_labels_must_match_the_declared_ones() -> None:
    family = _Family("counter", "c", "doc", ("route", "method"))
    with pytest.raises(ValueError, match="takes labels"):
        family.labels("stream")
