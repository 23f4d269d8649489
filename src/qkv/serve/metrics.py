"""GET /metrics: the engine's counters in Prometheus' text format (prometheus-client), per app (a registry of
its own, so several servers in one process, e.g. tests, do not collide). Names follow vLLM's where one
exists (num_requests_running / waiting, prompt / generation tokens, time to first token)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_GAUGES = {
    "running": ("qkv_num_requests_running", "requests in the running batch"),
    "waiting": ("qkv_num_requests_waiting", "requests queued in the engine (preempted ones included)"),
    "preempted_waiting": (
        "qkv_num_requests_preempted_waiting",
        "preempted requests waiting to be recomputed",
    ),
    "blocks_used": ("qkv_kv_blocks_used", "KV-cache blocks referenced by requests"),
    "blocks_cached": (
        "qkv_kv_blocks_cached",
        "unreferenced blocks kept by the prefix cache (free, evictable)",
    ),
    "blocks_total": ("qkv_kv_blocks_total", "KV-cache blocks in the pool"),
    "prefix_hit_rate": ("qkv_prefix_cache_hit_rate", "prompt tokens found in the prefix cache / looked up"),
    "image_cache_entries": ("qkv_image_cache_entries", "projected image embeddings held by the LRU"),
}
_COUNTERS = {
    "prompt_tokens": ("qkv_prompt_tokens", "prompt tokens of admitted requests"),
    "generated_tokens": ("qkv_generation_tokens", "generated tokens"),
    "prefill_tokens": ("qkv_prefill_tokens", "tokens computed by prefill (prefix-cache hits excluded)"),
    "prefix_hit_tokens": ("qkv_prefix_cache_hit_tokens", "prompt tokens reused from the prefix cache"),
    "preemptions": ("qkv_preemptions", "requests preempted (blocks freed, recomputed later)"),
    "recomputed_tokens": ("qkv_recomputed_tokens", "computed tokens thrown away by preemption"),
    "evictions": ("qkv_prefix_cache_evictions", "cached blocks reused for other content"),
    "steps": ("qkv_engine_steps", "engine steps"),
    "image_requests": ("qkv_image_requests", "admitted requests with images"),
    "images_encoded": ("qkv_images_encoded", "images run through the vision tower (not found in the LRU of "
                       "projected embeddings, nor in prefix-cached blocks)"),
    "image_cache_hits": ("qkv_image_cache_hits", "images whose projected embeddings the LRU held"),
    "spec_draft_tokens": ("qkv_spec_decode_draft_tokens", "tokens drafted by speculative decoding"),
    "spec_accepted_tokens": ("qkv_spec_decode_accepted_tokens", "drafted tokens the model accepted"),
}


class _EngineCollector:
    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def collect(self):
        st = self.worker.stats
        for key, (name, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(st[key]))
            yield g
        for key, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(st[key]))
            yield c


class Metrics:
    def __init__(self, worker: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(worker))
        self.requests = Counter("qkv_requests", "finished HTTP generation requests by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.rejected = Counter("qkv_requests_rejected_full", "requests answered 429 (queue full)",
                                registry=self.registry)
        self.responses = Counter("qkv_http_responses", "HTTP responses by endpoint and status code (4xx: the "
                                 "client's error, 5xx: the server's), counted when the response starts",
                                 ["endpoint", "status"], registry=self.registry)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("qkv_time_to_first_token_seconds", "request accepted -> first token",
                              buckets=buckets, registry=self.registry)
        self.latency = Histogram("qkv_e2e_request_latency_seconds", "request accepted -> finished",
                                 buckets=buckets, registry=self.registry)

    def observe(self, ticket: Any, reason: str | None) -> None:
        self.requests.labels(reason or "cancelled").inc()
        if ticket.first_token is not None:
            self.ttft.observe(ticket.first_token - ticket.created)
        self.latency.observe(time.monotonic() - ticket.created)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# the routes a response is counted under; any other path (a typo, a scanner) is "other", so that unknown paths
# cannot grow the number of series without bound
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ResponseCounter:
    """ASGI middleware counting every HTTP response in `counter` (Metrics.responses) by endpoint and status
    code. A plain ASGI wrapper of `send`, not Starlette's BaseHTTPMiddleware, which would buffer streamed
    responses. An exception that escapes the app before any response started becomes the app's 500 (the error
    handler outside this middleware writes it), so it is counted as one here."""

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = (
            path if path in ENDPOINTS else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        )
        started = False

        async def counting_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.counter.labels(endpoint, "500").inc()
            raise
