"""Speculative decoding's Prometheus counters (vLLM's names) and its part of the stats log line."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from metalserve.engine.protocol import SchedulerStatsLike


class SpecDecodeMetrics:
    """Turns the scheduler's cumulative draft counters into Prometheus increments."""

    def __init__(self, registry: CollectorRegistry, labels: list[str]) -> None:
        r = registry
        self._drafts = Counter("vllm:spec_decode_num_drafts", "Verified draft windows.", labels, registry=r)
        self._draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", labels, registry=r
        )
        self._accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=r)
        self._per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each position of the window.",
            [*labels, "position"],
            registry=r,
        )
        # The cumulative counters last seen, per model (a reloaded model's core counts from zero: `forget`).
        self._last: dict[str, tuple[int, int, int]] = {}
        self._last_per_pos: dict[str, tuple[int, ...]] = {}

    def forget(self, model: str) -> None:
        self._last.pop(model, None)
        self._last_per_pos.pop(model, None)

    def observe(self, model: str, s: SchedulerStatsLike) -> None:
        now = (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)
        last = self._last.get(model, (0, 0, 0))
        if now == last:
            return
        for counter, new, old in zip((self._drafts, self._draft_tokens, self._accepted), now, last, strict=True):
            counter.labels(model).inc(max(new - old, 0))
        self._last[model] = now
        per_pos, old_pos = s.spec_accepted_per_pos, self._last_per_pos.get(model, ())
        for i, value in enumerate(per_pos):
            self._per_pos.labels(model, str(i)).inc(max(value - (old_pos[i] if i < len(old_pos) else 0), 0))
        self._last_per_pos[model] = per_pos


def spec_log_suffix(num_drafts: int, num_draft_tokens: int, num_accepted: int) -> str:
    """vLLM's figures: acceptance rate and mean acceptance length (tokens per window, the bonus one too)."""
    rate = 100 * num_accepted / num_draft_tokens if num_draft_tokens else 0.0
    length = 1 + num_accepted / num_drafts if num_drafts else 0.0
    return (
        f", Spec decode: draft acceptance rate: {rate:.1f}%, mean acceptance length: {length:.2f}, "
        f"accepted: {num_accepted} tokens, drafted: {num_draft_tokens} tokens"
    )
