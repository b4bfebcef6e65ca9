"""CountedHistogram: values observed many at a time, exposed as prometheus-client's own Histogram
exposes the same observations."""

import random

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Histogram, generate_latest  # noqa: E402

from ddtree.server.metrics import CountedHistogram  # noqa: E402

BUCKETS = (0, 1, 2, 4, 8, 16, 32)


def exposition(registry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if not line.startswith("#") and "_created" not in line]


def test_counts_expose_what_observing_each_value_does():
    rng = random.Random(0)
    values = [rng.choice([0, 1, 1, 2, 3, 5, 8, 17, 40]) for _ in range(500)]  # 40: past the last bucket
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counted = CountedHistogram("h", "doc", BUCKETS, ours)
    plain = Histogram("h", "doc", buckets=BUCKETS, registry=theirs)
    for start in range(0, len(values), 37):  # in batches, as a request's rounds arrive
        batch = values[start:start + 37]
        counted.observe_counts({v: batch.count(v) for v in set(batch)})
    counted.observe(3)
    for v in values + [3]:
        plain.observe(v)
    assert exposition(ours) == exposition(theirs)
    assert any(line.startswith('h_bucket{le="+Inf"} 501.0') for line in exposition(ours))


def test_an_empty_histogram_exposes_zero_counts():
    registry = CollectorRegistry()
    CountedHistogram("h", "doc", BUCKETS, registry)
    theirs = CollectorRegistry()
    Histogram("h", "doc", buckets=BUCKETS, registry=theirs)
    assert exposition(registry) == exposition(theirs)
