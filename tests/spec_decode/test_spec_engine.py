"""The engine with speculation on gives the same text as with it off: greedy, seeded sampling with the
whole pipeline, chunked prefill and preemption, grammar-constrained windows; n-gram and draft model."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import numpy as np

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from metalserve.speculative_config import SpeculativeConfig
from metalserve.structured.compiler import GrammarCompiler
from metalserve.structured.params import StructuredOutputsParams
from tests.engine.test_core import tiny_loaded
from tests.structured.test_engine import SCHEMA, TOK, make_core, request, run, text

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 8  # layers * (K, V) * kv heads * head_dim * fp32 * block size


def tiny_core(spec: SpeculativeConfig | None, **config: object) -> EngineCore:
    defaults: dict[str, object] = {"kv_cache_memory": 1 << 22, "max_num_batched_tokens": 64, "block_size": 8}
    merged = {**defaults, **config, "speculative_config": spec}
    return build_engine_core(EngineConfig(**merged), tiny_loaded())  # type: ignore[arg-type]


def drive(core: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        core.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
    return got


def mixed_greedy(n: int, seed: int = 3) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        # Repeating motifs give prompt lookup something to find; lengths 3..90 mix decode and chunks.
        motif = rng.integers(0, 97, size=int(rng.integers(2, 6))).tolist()
        prompt = (motif * 40)[: int(rng.integers(3, 90))]
        params = SamplingParams(temperature=0, max_tokens=int(rng.integers(8, 40)), ignore_eos=True)
        out.append(Request(f"r{i}", prompt, params))
    return out


def test_greedy_32_requests_with_chunked_prefill_and_preemption_match_without_speculation() -> None:
    tight = {"kv_cache_memory": 40 * PER_BLOCK, "max_model_len": 256, "long_prefill_token_threshold": 24}
    off_core, on_core = tiny_core(None, **tight), tiny_core(NGRAM, **tight)
    off, on = drive(off_core, mixed_greedy(32)), drive(on_core, mixed_greedy(32))
    assert on == off
    stats = on_core.make_stats()
    assert stats.num_preemptions > 0 and off_core.make_stats().num_preemptions > 0
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # rejections happened too
    assert stats.num_free_blocks == stats.num_total_blocks


def pipeline_requests() -> list[Request]:
    prompt = [5, 6, 7, 8, 9] * 6
    cases = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.5, logit_bias={7: 5.0}),
        SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=30, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=40, logit_bias={7: 30.0}, min_tokens=5, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, max_tokens=33, logit_bias={11: 30.0}, logprobs=1),
        SamplingParams(temperature=1.0, min_p=0.1, seed=9, max_tokens=40, logit_bias={3: 4.0}, presence_penalty=1.0),
    ]
    return [Request(f"p{i}", prompt, params, eos_token_ids=frozenset({2})) for i, params in enumerate(cases)]


def test_seeded_sampling_with_penalties_bias_and_logprobs_matches_without_speculation() -> None:
    def outcome(spec: SpeculativeConfig | None) -> tuple[dict[str, list[int]], dict[str, list[float]], EngineCore]:
        core = tiny_core(spec)
        for r in pipeline_requests():
            core.add_request(r)
        tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(6)}
        logprobs: dict[str, list[float]] = {f"p{i}": [] for i in range(6)}
        while core.has_unfinished_requests():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs or []]
        return tokens, logprobs, core

    off_tokens, off_lps, _ = outcome(None)
    on_tokens, on_lps, core = outcome(NGRAM)
    assert on_tokens == off_tokens
    assert off_tokens["p3"][-1] == 7 and len(off_tokens["p3"]) == 6  # the stop id, once min_tokens allowed it
    for rid, lps in off_lps.items():
        assert len(on_lps[rid]) == len(lps) == (len(off_tokens[rid]) if rid in ("p0", "p4") else 0)
        assert np.allclose(on_lps[rid], lps, atol=1e-3)
    assert core.make_stats().spec_num_accepted_tokens > 0


def test_grammar_constrained_windows_are_masked_per_position_and_match() -> None:
    compiler = GrammarCompiler(TOK)
    grammars = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"(ab|cd){3,9}-(yes|no)")]
    prompt = list(TOK.encode("ababcdcdab-yes ababcd-no", add_special_tokens=False))

    def reqs() -> list[Request]:
        out = []
        for i in range(6):
            r = request(f"g{i}", compiler, grammars[i % 2], seed=i, temperature=0.0 if i < 2 else 1.0)
            r.prompt_token_ids = list(prompt)
            out.append(r)
        return out

    on, off = make_core(speculative_config=NGRAM), make_core()
    tokens_on, reasons, _ = run(on, reqs())
    tokens_off, _, _ = run(off, reqs())
    assert tokens_on == tokens_off
    stats = on.make_stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    for i in range(0, 6, 2):
        jsonschema.validate(json.loads(text(tokens_on[f"g{i}"])), SCHEMA)
        assert re.fullmatch(r"(ab|cd){3,9}-(yes|no)", text(tokens_on[f"g{i + 1}"]))
    assert all(reasons[f"g{i}"] == "stop" for i in range(6))


def test_a_model_with_recurrent_layers_runs_without_speculation() -> None:
    from metalserve.kvcache.specs import FullAttention, RecurrentState, SlidingWindow
    from metalserve.serving.parts import speculation_for

    config = EngineConfig(block_size=8, speculative_config=NGRAM)
    windowed = [FullAttention(layers=(0,)), SlidingWindow(layers=(1,), window=16)]
    assert speculation_for(config, windowed) == NGRAM
    assert speculation_for(config, [FullAttention(layers=(0,)), RecurrentState(layers=(1,))]) is None
    assert speculation_for(config, [FullAttention(layers=(0, 1))]) == NGRAM


def draft_core(draft_seed: int, **config: object) -> EngineCore:
    """The tiny target with a tiny draft: the same weights (seed 0, a perfect draft) or other ones."""
    from tests.executor.tiny_models import tiny_model

    draft = tiny_loaded()
    draft.model = tiny_model("llama", seed=draft_seed)
    defaults: dict[str, object] = {"kv_cache_memory": 1 << 22, "max_num_batched_tokens": 64, "block_size": 8}
    spec = SpeculativeConfig("draft_model", num_speculative_tokens=3)
    merged = {**defaults, **config, "speculative_config": spec}
    return build_engine_core(EngineConfig(**merged), tiny_loaded(), draft=draft)  # type: ignore[arg-type]


def test_the_memory_plan_counts_the_draft_models_kv_at_every_block() -> None:
    # The draft here is the target's architecture: each block id costs twice a target block.
    target = tiny_core(None, kv_cache_memory=40 * PER_BLOCK, max_model_len=128)
    drafted = draft_core(0, kv_cache_memory=40 * PER_BLOCK, max_model_len=128)
    assert target.scheduler.kv.pool.num_blocks == 40
    assert drafted.scheduler.kv.pool.num_blocks == 20


def test_draft_model_greedy_32_requests_with_chunked_prefill_and_preemption_match() -> None:
    tight = {"kv_cache_memory": 40 * PER_BLOCK, "max_model_len": 256, "long_prefill_token_threshold": 24}
    off = drive(tiny_core(None, **tight), mixed_greedy(32))
    for draft_seed in (0, 1):
        # The same 40 blocks of the target, with the draft's K/V at each.
        core = draft_core(draft_seed, **(tight | {"kv_cache_memory": 80 * PER_BLOCK}))
        assert drive(core, mixed_greedy(32)) == off
        stats = core.make_stats()
        assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0
        rate = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
        # The target's own weights as the draft agree nearly always; another model's rarely.
        assert rate > 0.9 if draft_seed == 0 else rate < 0.5


def test_draft_model_pools_grow_with_the_target_and_sampling_matches(monkeypatch: object) -> None:
    from metalserve.kvcache import plan as kv_plan

    monkeypatch.setattr(kv_plan, "INITIAL_POOL_BLOCKS", 4)  # type: ignore[attr-defined]
    core = draft_core(0)
    tokens = drive(core, pipeline_requests())
    assert tokens == drive(tiny_core(None), pipeline_requests())
    proposer = core.runner.proposer
    assert proposer.spec.num_blocks == core.runner.spec.num_blocks > 4  # type: ignore[union-attr]
    assert core.make_stats().spec_num_accepted_tokens > 0
    assert core.shrink_kv_pool() > 0  # idle: the draft's pools are cut back with the target's
    assert proposer.spec.num_blocks == core.runner.spec.num_blocks == 4  # type: ignore[union-attr]
    assert drive(core, pipeline_requests()) == tokens


def test_a_draft_with_another_vocabulary_is_refused() -> None:
    import pytest

    from metalserve.config import ConfigError
    from tests.executor.tiny_models import tiny_model

    draft = tiny_loaded()
    draft.model = tiny_model("llama", vocab_size=50)
    config = EngineConfig(
        kv_cache_memory=1 << 22,
        block_size=8,
        speculative_config=SpeculativeConfig("draft_model", num_speculative_tokens=2),
    )
    with pytest.raises(ConfigError, match="vocabulary"):
        build_engine_core(config, tiny_loaded(), draft=draft)


class OracleProposer:
    """Drafts the tokens the run without speculation produced, the last one of every other window
    wrong: windows accepted whole, in part and not at all, on any model."""

    def __init__(self, expected: dict[str, list[int]], k: int) -> None:
        self.expected, self.k, self.calls = expected, k, 0

    def propose(self, requests: list[Any], limits: dict[str, int]) -> dict[str, list[int]]:
        out = {}
        for r in requests:
            n = limits.get(r.request_id, 0)
            drafts = list(self.expected[r.request_id][len(r.token_ids) : len(r.token_ids) + n])
            self.calls += 1
            if drafts and self.calls % 2:
                drafts[-1] = (drafts[-1] + 1) % 256
            if drafts:
                out[r.request_id] = drafts
        return out

    def forget(self, request_id: str) -> None:
        return None

    def grow(self, num_blocks: int) -> None:
        return None

    def truncate(self, num_blocks: int) -> None:
        return None


def test_a_sliding_window_model_speculates_with_the_same_text_under_preemption() -> None:
    # Rejected drafts roll num_computed_tokens back to no less than it was when the step was scheduled,
    # and a window group frees only blocks behind that point: nothing a rollback needs is ever freed.
    from metalserve.executor.models.families import kv_cache_spec
    from tests.models import golden
    from tests.models.archs import build

    loaded = golden.loaded_of(build("gemma3_text"), "gemma3_text")  # window 16: prompts run far past it
    per_block = kv_cache_spec(loaded, 16).bytes_per_block
    batch = golden.prompts([120, 90, 150, 60], 256, seed=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def core_with(spec: SpeculativeConfig | None) -> EngineCore:
        config = EngineConfig(
            kv_cache_memory=31 * per_block,
            max_model_len=200,
            block_size=16,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            speculative_config=spec,
        )
        return build_engine_core(config, golden.loaded_of(build("gemma3_text"), "gemma3_text"))

    def requests() -> list[Request]:
        return [Request(f"w{i}", p, params) for i, p in enumerate(batch)]

    off = drive(core_with(None), requests())
    assert core_with(NGRAM).runner.proposer is not None  # windows do not turn speculation off
    core = core_with(NGRAM)
    expected = {f"w{i}": p + off[f"w{i}"] for i, p in enumerate(batch)}
    core.runner.proposer = OracleProposer(expected, NGRAM.num_speculative_tokens)
    assert drive(core, requests()) == off
    stats = core.make_stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.num_free_blocks == stats.num_total_blocks


def test_only_decode_steps_feed_the_step_cost_fit() -> None:
    core = tiny_core(NGRAM, max_num_seqs=4)  # 4 x (1 + 4 drafts) = 20 tokens at most in a decode step
    drive(core, mixed_greedy(12))  # prompts up to 90 tokens: 64-token prefill chunks beside decodes
    samples = core.runner.drafting.cost.samples
    assert samples and max(tokens for tokens, _ in samples) <= 4 * (1 + NGRAM.num_speculative_tokens)
