"""Prometheus metrics with vLLM's names, and the periodic throughput log line."""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from metalserve.api.kv_disk_metrics import KVDiskMetrics, disk_log_suffix
from metalserve.api.spec_metrics import SpecDecodeMetrics, spec_log_suffix
from metalserve.api.step_window import StepWindow
from metalserve.engine.async_engine import IterationStats
from metalserve.engine.protocol import SchedulerStatsLike
from metalserve.kvcache.connector.base import ConnectorStats

logger = logging.getLogger("metalserve.stats")

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class MetricSeries:
    """The Prometheus series of one app, every one labelled with model_name (as vLLM's): one registry per
    app, so tests do not clash, shared by the observers of all its models."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.", labels, registry=r)
        self.queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        )
        self.hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r)
        self.preempt = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", labels, registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", labels, registry=r)
        self.gen = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.pooling = Counter(
            "metalserve:pooling_requests",
            "Finished pooling requests (embeddings, score and rerank inputs).",
            labels,
            registry=r,
        )
        self.loaded = Gauge("metalserve:model_loaded", "1 while the model is loaded, else 0.", labels, registry=r)
        self.memory = Gauge(
            "metalserve:model_memory_bytes",
            "Weights plus the KV pool at its largest, while loaded.",
            labels,
            registry=r,
        )
        # LoRA adapters (--enable-lora): the model's series count every request; these split out each adapter's.
        lora = [*labels, "lora_name"]
        self.lora_gen = Counter(
            "metalserve:lora_generation_tokens", "Tokens generated under a LoRA adapter.", lora, registry=r
        )
        self.lora_success = Counter(
            "metalserve:lora_request_success",
            "Finished requests under a LoRA adapter.",
            [*lora, "finished_reason"],
            registry=r,
        )
        self.spec = SpecDecodeMetrics(r, labels)
        self.kv_disk = KVDiskMetrics(r, labels)

    def model_unloaded(self, model_name: str) -> None:
        """An unloaded model runs nothing and holds nothing."""
        for gauge in (self.running, self.waiting, self.kv, self.loaded, self.memory):
            gauge.labels(model_name).set(0)


class Metrics:
    """An EngineObserver of one model's engine: Prometheus increments, the stats log line and the recent
    window the status page reads. A reloaded model gets a new one (its core counts from zero again)."""

    def __init__(self, model_name: str, series: MetricSeries | None = None) -> None:
        self.series = MetricSeries() if series is None else series
        self.registry = self.series.registry
        self._model = model_name
        self._last_cumulative = (0, 0, 0)
        self.series.spec.forget(model_name)
        self.series.kv_disk.forget(model_name)
        self.log_state = StatLogState()
        self.window = StepWindow()
        self.latest: SchedulerStatsLike | None = None

    def on_step(self, scheduler_stats: SchedulerStatsLike, iteration: IterationStats) -> None:
        """Called from the engine thread after every step."""
        m, series = self._model, self.series
        s = scheduler_stats
        series.running.labels(m).set(s.num_running)
        series.waiting.labels(m).set(s.num_waiting)
        series.kv.labels(m).set(s.kv_cache_usage)
        # The core's counters are cumulative; Prometheus counters take increments.
        queries, hits, preemptions = s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions
        last_q, last_h, last_p = self._last_cumulative
        series.queries.labels(m).inc(max(queries - last_q, 0))
        series.hits.labels(m).inc(max(hits - last_h, 0))
        series.preempt.labels(m).inc(max(preemptions - last_p, 0))
        self._last_cumulative = (queries, hits, preemptions)
        series.prompt.labels(m).inc(iteration.num_prompt_tokens)
        series.gen.labels(m).inc(iteration.num_generation_tokens)
        if iteration.num_pooling_requests:
            series.pooling.labels(m).inc(iteration.num_pooling_requests)
        for value in iteration.time_to_first_tokens:
            series.ttft.labels(m).observe(value)
        for value in iteration.inter_token_latencies:
            series.itl.labels(m).observe(value)
        for reason, latency in iteration.finished:
            series.e2e.labels(m).observe(latency)
            series.success.labels(m, reason).inc()
        for adapter, count in iteration.lora_generation_tokens.items():
            series.lora_gen.labels(m, adapter).inc(count)
        for adapter, reason in iteration.lora_finished:
            series.lora_success.labels(m, adapter, reason).inc()
        series.spec.observe(m, s)
        series.kv_disk.observe(m, s.connector)
        self.log_state.record(scheduler_stats, iteration)
        self.window.record(iteration)
        self.latest = scheduler_stats


class StatLogState:
    """Token counts since the last log line, and the latest scheduler snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prompt = 0
        self._gen = 0
        self._since = time.monotonic()
        self._stats: SchedulerStatsLike | None = None
        self._last_spec = (0, 0, 0)  # cumulative draft counters at the previous line
        self._last_disk: ConnectorStats | None = None  # the disk tier's counters at the previous line

    def record(self, stats: SchedulerStatsLike, iteration: IterationStats) -> None:
        with self._lock:
            self._prompt += iteration.num_prompt_tokens
            self._gen += iteration.num_generation_tokens
            self._stats = stats

    def line(self) -> str:
        """vLLM's periodic line; resets the token counts."""
        with self._lock:
            elapsed = max(time.monotonic() - self._since, 1e-9)
            prompt, gen, stats = self._prompt, self._gen, self._stats
            self._prompt = self._gen = 0
            self._since = time.monotonic()
        running = stats.num_running if stats else 0
        waiting = stats.num_waiting if stats else 0
        usage = 100 * stats.kv_cache_usage if stats else 0.0
        hit_rate = (
            100 * stats.prefix_cache_hits / stats.prefix_cache_queries if stats and stats.prefix_cache_queries else 0.0
        )
        return (
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {gen / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"GPU KV cache usage: {usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
            f"{self._spec_suffix(stats)}{self._disk_suffix(stats)}"
        )

    def _disk_suffix(self, stats: SchedulerStatsLike | None) -> str:
        now = stats.connector if stats is not None else None
        last, self._last_disk = self._last_disk, now or self._last_disk
        return disk_log_suffix(now, last)

    def _spec_suffix(self, stats: SchedulerStatsLike | None) -> str:
        """The draft acceptance since the previous line (nothing while speculation never ran)."""
        if stats is None or not stats.spec_num_drafts:
            return ""
        now = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        last, self._last_spec = self._last_spec, now
        return spec_log_suffix(*(a - b for a, b in zip(now, last, strict=True)))

    def log(self) -> None:
        logger.info(self.line())
