"""What the benchmark scripts share. They run as ``python bench/<name>.py``, which puts this
directory first on the import path."""

from __future__ import annotations


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]


def latency(samples: list[float]) -> str:
    """``p50 … ms   p99 … ms`` of samples in milliseconds."""
    return f"p50 {percentile(samples, 0.5):6.2f} ms   p99 {percentile(samples, 0.99):6.2f} ms"


def producer_headers(content_type: str, producer: str, seq: int) -> dict[str, str]:
    """The headers of an idempotent producer's append (epoch 0)."""
    return {
        "Content-Type": content_type,
        "Producer-Id": producer,
        "Producer-Epoch": "0",
        "Producer-Seq": str(seq),
    }
