"""The KV disk tier's Prometheus metrics (vLLM-style names) and its part of the stats log line.

vLLM counts a KV connector's prefix hits as `vllm:external_prefix_cache_{queries,hits}` (tokens); the
disk's own traffic, load time and size get `vllm:kv_disk_*` names beside them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from metalserve.kvcache.connector.base import ConnectorStats


class KVDiskMetrics:
    """Turns the connector's cumulative counters into Prometheus increments."""

    def __init__(self, registry: CollectorRegistry, labels: list[str]) -> None:
        r = registry
        self._counters = {
            "queries": Counter(
                "vllm:external_prefix_cache_queries",
                "Prompt tokens looked up in the KV disk tier (past the RAM prefix cache).",
                labels,
                registry=r,
            ),
            "hits": Counter(
                "vllm:external_prefix_cache_hits", "Prompt tokens loaded from the KV disk tier.", labels, registry=r
            ),
            "bytes_loaded": Counter(
                "vllm:kv_disk_bytes_loaded", "Bytes of KV blocks read from disk.", labels, registry=r
            ),
            "bytes_saved": Counter(
                "vllm:kv_disk_bytes_saved", "Bytes of KV blocks written to disk.", labels, registry=r
            ),
            "load_seconds": Counter(
                "vllm:kv_disk_load_seconds", "Seconds spent reading and checking KV blocks.", labels, registry=r
            ),
        }
        self._usage = Gauge("vllm:kv_disk_usage_bytes", "Bytes the KV disk directory holds.", labels, registry=r)
        self._capacity = Gauge("vllm:kv_disk_capacity_bytes", "--kv-disk-size.", labels, registry=r)
        self._last: dict[str, ConnectorStats] = {}  # per model: the counters at the previous step

    def forget(self, model: str) -> None:
        """A (re)loaded model's core counts from zero again."""
        self._last.pop(model, None)

    def observe(self, model: str, stats: ConnectorStats | None) -> None:
        if stats is None:
            return
        last = self._last.get(model, ConnectorStats())
        for name, counter in self._counters.items():
            counter.labels(model).inc(max(getattr(stats, name) - getattr(last, name), 0))
        self._usage.labels(model).set(stats.usage_bytes)
        self._capacity.labels(model).set(stats.capacity_bytes)
        self._last[model] = stats


def disk_log_suffix(now: ConnectorStats | None, last: ConnectorStats | None) -> str:
    """The disk hit rate since the previous line (over tokens looked up past the RAM cache)."""
    if now is None:
        return ""
    queries = now.queries - (last.queries if last else 0)
    hits = now.hits - (last.hits if last else 0)
    rate = 100 * hits / queries if queries else 0.0
    return f", Disk KV hit rate: {rate:.1f}%, disk: {now.usage_bytes / 2**20:.0f} MiB"
