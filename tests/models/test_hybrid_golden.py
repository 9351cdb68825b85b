"""Hybrid models served by the real engine give mlx-lm's own greedy tokens (and logprobs within 1e-2):
alone, batched with chunked prefill, from the prefix cache, and after a preemption mid-prefill."""

from __future__ import annotations

import mlx.nn as nn
import pytest

from metalserve.engine.core import EngineCore
from tests.models.hybrid_golden import assert_matches, engine, mlx_lm_greedy, prompts_of, serve
from tests.models.hybrid_tiny import HYBRID_TYPES, tiny_hybrid_loaded

N = 12
# One architecture runs every scenario in the default run; the others' costlier cases are slow.
DEFAULT_ARCH = "qwen3_5"


def _slow_unless_default(model_types: tuple[str, ...]) -> list[object]:
    return [t if t == DEFAULT_ARCH else pytest.param(t, marks=pytest.mark.slow) for t in model_types]


@pytest.mark.parametrize("attention", ["auto", "mlx"])
@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_a_short_prompt_alone_matches_mlx_lm(model_type: str, attention: str) -> None:
    (prompt,) = prompts_of([21])
    expected = mlx_lm_greedy(model_type, prompt, N)
    (got,) = serve(engine(tiny_hybrid_loaded(model_type), attention=attention), [prompt], N)
    assert_matches(got, expected)


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_quantized_weights_stay_quantized_and_match_mlx_lm(model_type: str) -> None:
    (prompt,) = prompts_of([40], seed=4)
    expected = mlx_lm_greedy(model_type, prompt, N, bits=4)
    loaded = tiny_hybrid_loaded(model_type, bits=4)
    (got,) = serve(engine(loaded, budget=16), [prompt], N)  # chunked too: 16 tokens a step
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    assert_matches(got, expected)


@pytest.mark.parametrize("model_type", _slow_unless_default(HYBRID_TYPES))
def test_batched_chunked_prefill_then_the_prefix_cache_match_mlx_lm(model_type: str) -> None:
    prompts = prompts_of([21, 300], seed=2)
    expected = [mlx_lm_greedy(model_type, p, N) for p in prompts]
    (alone,) = serve(engine(tiny_hybrid_loaded(model_type)), prompts[1:], N)  # one 300-token chunk
    assert_matches(alone, expected[1])
    core = engine(tiny_hybrid_loaded(model_type), budget=40)  # chunks end on block boundaries: 32 tokens
    for got, want in zip(serve(core, prompts, N), expected, strict=True):
        assert_matches(got, want)
    hits = core.scheduler.kv.prefix_cache_hits
    for got, want in zip(serve(core, prompts, N, tag="again"), expected, strict=True):
        assert_matches(got, want)
    assert core.scheduler.kv.prefix_cache_hits - hits >= 256  # resumed from the snapshot at 256 tokens
    # A new prompt sharing 200 tokens resumes from the last snapshot before 200: the first run's chunks
    # ended at 16 (next to the short prompt's 21), then every 32 tokens: 48, 80, ..., 176, 208.
    shared = prompts[1][:200] + prompts_of([50], seed=9)[0]
    hits = core.scheduler.kv.prefix_cache_hits
    (got,) = serve(core, [shared], N, tag="shared")
    assert core.scheduler.kv.prefix_cache_hits - hits == 176
    assert_matches(got, mlx_lm_greedy(model_type, shared, N))


def _preempted_mid_prefill(core: EngineCore) -> list[str]:
    """Record which requests the scheduler preempts before they produced any token."""
    seen: list[str] = []
    schedule = core.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        seen.extend(r for r in out.preempted_req_ids if not core.scheduler.requests[r].output_token_ids)
        return out

    core.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return seen


# Without prefix caching the resumed request recomputes from zeros; with it, chunks are block-aligned and
# it may resume from a snapshot of its own. Both for the default architecture, the aligned case for all.
PREEMPTION_CASES = [(DEFAULT_ARCH, False)] + [
    (t, True) if t == DEFAULT_ARCH else pytest.param(t, True, marks=pytest.mark.slow) for t in HYBRID_TYPES
]


@pytest.mark.parametrize(("model_type", "caching"), PREEMPTION_CASES)
def test_a_request_preempted_mid_prefill_resumes_with_the_same_tokens(model_type: str, caching: bool) -> None:
    prompts, counts = prompts_of([64, 300], seed=3), [40, N]
    expected = [mlx_lm_greedy(model_type, p, n) for p, n in zip(prompts, counts, strict=True)]
    # 25 blocks: the 352-token context in both groups (22 + 2) and the null block, less than both need;
    # with 27 the victim's own blocks and its last state snapshot survive until it is admitted again.
    loaded = tiny_hybrid_loaded(model_type)
    core = engine(loaded, budget=32, num_blocks=27 if caching else 25, max_model_len=352, caching=caching)
    preempted = _preempted_mid_prefill(core)
    got = serve(core, prompts, counts)  # the short one arrives first, so the long one is the victim
    assert "r1" in preempted
    assert (core.scheduler.kv.prefix_cache_hits >= 256) == caching  # it resumed from its snapshot at 256
    for g, want in zip(got, expected, strict=True):
        assert_matches(g, want)
