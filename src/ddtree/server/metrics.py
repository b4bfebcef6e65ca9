"""Prometheus metrics of one server (prometheus-client, a registry of its own so several servers
can live in one process, as in the tests). Scraped as text at GET /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
_TREE_SIZE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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
        self.acceptance_length = Histogram("ddtree_acceptance_length", "Tokens committed per request per round "
                                           "(accepted draft tokens + the bonus; 1 in ar)", buckets=_ACCEPT_BUCKETS,
                                           registry=registry)
        self.tree_size = Histogram("ddtree_tree_size", "Tree nodes verified per request per round (0: a plain "
                                   "decode step; budget \"auto\" chooses it each round)", buckets=_TREE_SIZE_BUCKETS,
                                   registry=registry)
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
        gauges = [("running", "ddtree_requests_running", "Requests in the running batch"),
                  ("queued", "ddtree_requests_queued", "Requests accepted and waiting for a batch slot"),
                  ("pages_in_use", "ddtree_kv_pages_in_use", "KV cache pages held by requests"),
                  ("pages_free", "ddtree_kv_pages_free", "KV cache pages on the free list"),
                  ("pages_promised", "ddtree_kv_pages_promised", "KV cache pages promised to admitted requests "
                   "(their worst case; admission is decided by this)")]
        for key, name, doc in gauges:
            Gauge(name, doc, registry=registry).set_function(lambda key=key: self._snapshot.get(key, 0))

    def publish(self, snapshot: dict) -> None:
        """Replace the gauges' values (one dict swap: scrapes see one consistent snapshot)."""
        self._snapshot = dict(snapshot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
