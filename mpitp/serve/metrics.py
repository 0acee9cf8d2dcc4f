"""``GET /metrics``: the server's state in Prometheus' text format (prometheus_client).

Names follow vLLM's (``vllm:...``) with an ``mpitp:`` prefix, so a vLLM Grafana board
works with the prefix changed. Rank 0 alone keeps them: it admits, samples and finishes
every request.

    mpitp:num_requests_running / _waiting         gauges
    mpitp:request_success_total{finished_reason}  counter (stop, length, abort, cancelled)
    mpitp:prompt_tokens_total, generation_tokens_total
    mpitp:time_to_first_token_seconds             histogram, from arrival to the first token
    mpitp:inter_token_latency_seconds             histogram, between a request's tokens
    mpitp:e2e_request_latency_seconds             histogram, from arrival to the end
    mpitp:kv_cache_usage_perc                     gauge, the share of cache rows x columns in use
    mpitp:prefix_cache_queries_total, _hits_total prompt tokens looked up in the prefix cache, found
    mpitp:pipeline_overlapped_steps_total         counter, forwards started while an earlier
                                                  micro-batch was still unsampled (--pp: stages busy at once)
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "Metrics"]

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class Metrics:
    def __init__(self, model_name: str, waiting=lambda: 0):
        self.registry = r = CollectorRegistry()
        label = {"labelnames": ["model_name"]}
        self.running = Gauge("mpitp:num_requests_running", "Requests in the batch.", registry=r, **label)
        self.waiting = Gauge("mpitp:num_requests_waiting", "Requests queued for a row.", registry=r, **label)
        self.success = Counter(
            "mpitp:request_success", "Finished requests.", ["model_name", "finished_reason"], registry=r
        )
        self.prompt = Counter("mpitp:prompt_tokens", "Prefilled prompt tokens.", registry=r, **label)
        self.generated = Counter("mpitp:generation_tokens", "Generated tokens.", registry=r, **label)
        hist = dict(registry=r, buckets=LATENCY_BUCKETS, **label)
        self.ttft = Histogram("mpitp:time_to_first_token_seconds", "Arrival to first token.", **hist)
        self.itl = Histogram("mpitp:inter_token_latency_seconds", "Between a request's tokens.", **hist)
        self.e2e = Histogram("mpitp:e2e_request_latency_seconds", "Arrival to the end.", **hist)
        self.kv = Gauge("mpitp:kv_cache_usage_perc", "KV-cache rows x columns in use (0-1).", registry=r, **label)
        self.queries = Counter("mpitp:prefix_cache_queries", "Prompt tokens looked up.", registry=r, **label)
        self.hits = Counter("mpitp:prefix_cache_hits", "Prompt tokens found cached.", registry=r, **label)
        self.overlapped = Counter(
            "mpitp:pipeline_overlapped_steps",
            "Forwards started while an earlier micro-batch was still unsampled (pipeline stages in flight).",
            registry=r,
            **label,
        )
        self.seen = (0, 0)  # the engine's running totals at the last update
        self.name = model_name
        every = (self.running, self.waiting, self.prompt, self.generated, self.ttft, self.itl, self.e2e, self.kv)
        for m in every + (self.queries, self.hits, self.overlapped):
            m.labels(model_name)  # every series from the first scrape on, at 0
        for reason in ("stop", "length", "abort", "cancelled"):
            self.success.labels(model_name, reason)
        self.waiting.labels(model_name).set_function(waiting)  # the queue's length at each scrape

    def admitted(self, r) -> None:
        self.prompt.labels(self.name).inc(len(r.job.ids))
        self.running.labels(self.name).inc()
        r.admitted = True

    def token(self, r) -> None:
        """A token of ``r`` was made (``r.made`` already counts it)."""
        now = time.monotonic()
        self.generated.labels(self.name).inc()
        if r.made == 1:
            self.ttft.labels(self.name).observe(now - r.arrived)
        else:
            self.itl.labels(self.name).observe(now - r.last_token_at)
        r.last_token_at = now

    def finished(self, r, reason: str) -> None:
        """``r`` ended (before or after it was admitted: a cancelled request may never be)."""
        self.success.labels(self.name, reason).inc()
        if r.admitted:
            self.running.labels(self.name).dec()
        self.e2e.labels(self.name).observe(time.monotonic() - r.arrived)

    def kv_used(self, share: float) -> None:
        self.kv.labels(self.name).set(share)

    def prefix(self, queries: int, hits: int) -> None:
        """The prefix cache's running totals (tokens looked up, found)."""
        q0, h0 = self.seen
        self.queries.labels(self.name).inc(queries - q0)
        self.hits.labels(self.name).inc(hits - h0)
        self.seen = (queries, hits)

    def text(self) -> bytes:
        return generate_latest(self.registry)
