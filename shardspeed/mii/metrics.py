"""``/metrics`` in Prometheus' text format (prometheus_client), one registry per server.

Counted as requests happen: requests by route (its template) and status, prompt tokens (and how many came from the prefix
cache), generated tokens, time to first token, time between tokens. Read from the batcher when scraped:
queue depth, running batch, KV blocks in use and cached.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's counters and histograms; gauges read ``batcher`` at scrape time."""

    def __init__(self, batcher, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "shardspeed_requests", "HTTP requests answered", ["route", "status"], registry=registry
        )
        self.prompt_tokens = Counter(
            "shardspeed_prompt_tokens", "Prompt tokens of requests", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            "shardspeed_prompt_tokens_cached",
            "Prompt tokens whose KV came from the prefix cache",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "shardspeed_generation_tokens", "Tokens generated", registry=registry
        )
        self.time_to_first_token = Histogram(
            "shardspeed_time_to_first_token_seconds", "From request to its first token",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "shardspeed_inter_token_latency_seconds", "Between two tokens of one request",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        gauges = {
            "shardspeed_queue_depth": ("Requests waiting for a batch slot", lambda: len(batcher.waiting)),
            "shardspeed_running_requests": ("Requests in the running batch", lambda: len(batcher.running)),
            "shardspeed_kv_blocks_in_use": ("KV cache blocks held by requests", lambda: batcher.cache.pool.in_use),
            "shardspeed_kv_blocks_total": ("KV cache blocks in the pool", lambda: batcher.cache.num_blocks),
            "shardspeed_kv_blocks_cached": ("KV blocks registered in the prefix cache", lambda: batcher.cache.pool.cached),
        }  # fmt: skip
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(read)
        Gauge("shardspeed_model_info", "The served model", ["model"], registry=registry).labels(
            model_name
        ).set(1)

    def request_done(self, route: str | None, status: int) -> None:
        """Count an answered request under its route's template (``/v1/models/{model}``), not its path:
        one series per route whatever the client puts in the path; no route matched: "other"."""
        self.requests.labels(route or "other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
