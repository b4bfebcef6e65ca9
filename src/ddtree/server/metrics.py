"""Prometheus metrics of one server (prometheus-client, a registry of its own so several servers
can live in one process, as in the tests). Scraped as text at GET /metrics."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
_TREE_SIZE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class CountedHistogram:
    """A Prometheus histogram of values observed many at a time (one per request and round: in `ar`
    one per token), kept as a count per distinct value and exposed at scrape time through
    prometheus-client's custom-collector API. observe_counts adds a request's rounds in one call,
    where Histogram.observe would cost a call and a lock per value."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation, self.buckets = name, documentation, tuple(buckets)
        self._counts: dict[float, int] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_counts({value: 1})

    def observe_counts(self, counts: dict[float, int]) -> None:
        """Observe each value `count` times ({value: count})."""
        with self._lock:
            for value, count in counts.items():
                self._counts[value] = self._counts.get(value, 0) + count

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self):
        with self._lock:
            counts = sorted(self._counts.items())
        cumulative, at, buckets = 0, 0, []
        for bound in self.buckets:
            while at < len(counts) and counts[at][0] <= bound:
                cumulative += counts[at][1]
                at += 1
            buckets.append((str(float(bound)), cumulative))
        buckets.append(("+Inf", sum(count for _, count in counts)))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                    sum_value=sum(value * count for value, count in counts))


class Metrics:
    """The server's metrics. Counters and histograms are updated where the event happens (the
    HTTP side for request outcomes, the scheduler thread for tokens and rounds); the gauges read
    the scheduler's latest snapshot when scraped."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("ddtree_requests", "Finished HTTP requests to the API endpoints, by endpoint and "
                                "status code (499: the client disconnected)", ["endpoint", "status"],
                                registry=registry)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens of accepted requests", registry=registry)
        self.generated_tokens = Counter("ddtree_generated_tokens", "Tokens committed to requests",
                                        registry=registry)
        self.acceptance_length = CountedHistogram(
            "ddtree_acceptance_length", "Tokens committed per request per round (accepted draft tokens + the bonus; "
            "1 in ar)", _ACCEPT_BUCKETS, registry)
        self.tree_size = CountedHistogram(
            "ddtree_tree_size", "Tree nodes verified per request per round (0: a plain decode step; budget \"auto\" "
            "chooses it each round)", _TREE_SIZE_BUCKETS, registry)
        self.round_seconds = Histogram("ddtree_round_seconds", "Wall time of one engine step (admission, prefill "
                                       "and one round for the running batch)", buckets=_ROUND_BUCKETS,
                                       registry=registry)
        self.time_to_first_token = Histogram("ddtree_time_to_first_token_seconds", "From acceptance to the first "
                                             "committed token", buckets=_LATENCY_BUCKETS, registry=registry)
        self.request_seconds = Histogram("ddtree_request_seconds", "From acceptance to the last token of requests "
                                         "that finished", buckets=_LATENCY_BUCKETS, registry=registry)
        self.engine_failures = Counter("ddtree_engine_step_failures", "Engine steps that raised (their running "
                                       "requests were failed with a 500)", registry=registry)
        self._snapshot = {}
        self.forward = None  # (endpoint, status) -> None: several API-server processes (count_request)
        gauges = [("running", "ddtree_requests_running", "Requests in the running batch"),
                  ("queued", "ddtree_requests_queued", "Requests accepted and waiting for a batch slot"),
                  ("pages_in_use", "ddtree_kv_pages_in_use", "KV cache pages held by requests"),
                  ("pages_free", "ddtree_kv_pages_free", "KV cache pages on the free list"),
                  ("pages_promised", "ddtree_kv_pages_promised", "KV cache pages promised to admitted requests "
                   "(their worst case; admission is decided by this)"),
                  ("eager_rounds", "ddtree_eager_rounds", "Rounds of a graphed engine run without their CUDA graph "
                   "since start-up, start-up's warming included (a new round shape's first round, which compiles; "
                   "0 where rounds have no graphs)"),
                  ("round_graphs", "ddtree_round_graphs", "Round CUDA graphs captured since start-up (start-up's "
                   "warming included: growth while serving is capture on the request path)")]
        for key, name, doc in gauges:
            Gauge(name, doc, registry=registry).set_function(lambda key=key: self._snapshot.get(key, 0))

    def count_request(self, endpoint: str, status: str) -> None:
        """One finished API request. With several API-server processes (`forward` set) the count goes
        to the engine core, whose registry every process's scrape reads."""
        if self.forward is not None:
            self.forward(endpoint, status)
        else:
            self.requests.labels(endpoint, status).inc()

    def publish(self, snapshot: dict) -> None:
        """Replace the gauges' values (one dict swap: scrapes see one consistent snapshot)."""
        self._snapshot = dict(snapshot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def graph_counts(engine) -> dict:
    """Rounds run eagerly (a plan's first round, or one past the graph limit) and round graphs
    captured since start-up (the gauges ddtree_eager_rounds / ddtree_round_graphs read them from the
    scheduler's snapshot): growth while serving is compile and capture on the request path."""
    graphs = engine.graphs
    return {"eager_rounds": graphs.eager_rounds if graphs is not None else 0,
            "round_graphs": graphs.captures if graphs is not None else 0}
