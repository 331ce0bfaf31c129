"""Prometheus metrics with prometheus-client, named as vLLM's (`vllm:` -> `bov:`) so that
dashboards written for vLLM adapt by changing the prefix.

Observed by the server per request (histograms, labelled by model_name):
    bov:time_to_first_token_seconds   arrival -> first generated token
    bov:inter_token_latency_seconds   between consecutive generated tokens
    bov:e2e_request_latency_seconds   arrival -> finish
    bov:request_queue_time_seconds    engine add -> admission (its first prefill chunk)
    bov:prompt_tokens_total, bov:generation_tokens_total, bov:request_success_total
    (by finished_reason: stop, length, abort)
Read from the engine at each scrape (gauges and counters):
    bov:num_requests_running, bov:num_requests_waiting, bov:kv_cache_usage_perc (a
    fraction, as vLLM's), bov:pages_used, bov:pages_free, bov:tokens_per_second (over the
    last seconds up to now: 0 when idle), bov:num_preemptions_total,
    bov:prefix_shared_tokens_total,
    bov:requests_aborted_total, bov:engine_steps_total
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bov_jax.inference.engine import Output

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
prometheus_client.disable_created_metrics()  # no *_created series (vLLM's exposition too)
# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineCollector(Collector):
    """The engine's state at scrape time (`Engine.stats`)."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        pages = s["pages_used"] + s["pages_free"]
        gauges = {
            "num_requests_running": ("Requests prefilling or decoding.", s["running"]),
            "num_requests_waiting": ("Requests queued for pages or a slot.", s["waiting"]),
            "kv_cache_usage_perc": (
                "Fraction of cache pages in use (1 = full).",
                s["pages_used"] / pages if pages else 0.0,
            ),
            "pages_used": ("Cache pages held by requests (all groups).", s["pages_used"]),
            "pages_free": ("Cache pages free (all groups).", s["pages_free"]),
            "tokens_per_second": ("Generated tokens a second, recent.", s["tokens_per_second"]),
        }
        counters = {
            "num_preemptions": ("Sequences preempted for pages.", s["preemptions"]),
            "prefix_shared_tokens": (
                "Prompt tokens taken from a running sequence's pages, not computed.",
                s["shared_tokens"],
            ),
            "requests_aborted": ("Requests aborted (client gone).", s["aborted"]),
            "engine_steps": ("Engine steps run.", s["steps"]),
        }
        for name, (text, value) in gauges.items():
            family = GaugeMetricFamily(f"bov:{name}", text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, (text, value) in counters.items():
            family = CounterMetricFamily(f"bov:{name}", text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class Metrics:
    """One server's registry (not the global one: several servers may share a process)."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels, r = ["model_name"], self.registry
        self.ttft = Histogram(
            "bov:time_to_first_token_seconds", "Time to the first generated token.",
            labels, registry=r, buckets=TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = Histogram(
            "bov:inter_token_latency_seconds", "Time between generated tokens.",
            labels, registry=r, buckets=ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "bov:e2e_request_latency_seconds", "Time from arrival to finish.",
            labels, registry=r, buckets=REQUEST_BUCKETS,
        )  # fmt: skip
        self.queue = Histogram(
            "bov:request_queue_time_seconds", "Time queued before admission.",
            labels, registry=r, buckets=REQUEST_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = Counter("bov:prompt_tokens", "Prompt tokens.", labels, registry=r)
        self.generation_tokens = Counter(
            "bov:generation_tokens", "Generated tokens.", labels, registry=r
        )
        self.finished = Counter(
            "bov:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r
        )
        r.register(EngineCollector(stats, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request(self, prompt_tokens: int, arrived: float) -> RequestTimer:
        """A timer for one engine request that arrived at `arrived` (time.monotonic())."""
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        return RequestTimer(self, arrived)


class RequestTimer:
    """Observes one engine request's outputs into the histograms."""

    def __init__(self, metrics: Metrics, arrived: float):
        self.m, self.arrived, self.last = metrics, arrived, None

    def observe(self, out: Output) -> None:
        m, name, now = self.m, self.m.model_name, time.monotonic()
        if out.queued_s is not None:
            m.queue.labels(name).observe(out.queued_s)
        if out.token_ids:
            if self.last is None:
                m.ttft.labels(name).observe(now - self.arrived)
            else:
                for _ in out.token_ids:
                    m.itl.labels(name).observe((now - self.last) / len(out.token_ids))
            self.last = now
        if out.finish_reason is not None:
            m.e2e.labels(name).observe(now - self.arrived)
            m.finished.labels(name, out.finish_reason).inc()
            m.generation_tokens.labels(name).inc(out.completion_tokens)
