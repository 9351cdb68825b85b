"""Sliding windows end to end: layer groups from the model, prompts far longer than the window, and the
blocks behind the window back in the pool, as the KV usage on /metrics shows."""

from __future__ import annotations

import re

import mlx.core as mx
from prometheus_client import generate_latest

from metalserve.api.metrics import Metrics
from metalserve.engine.request_output import IterationStats
from metalserve.executor.models.families import kv_cache_spec
from metalserve.executor.models.kv_layout import model_kv_layout
from metalserve.kvcache.specs import FullAttention, SlidingWindow
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from tests.models import golden
from tests.models.archs import VOCAB, WINDOW, build

BLOCK = 16


def test_windowed_models_have_a_full_and_a_sliding_group_sharing_the_pool_tensors() -> None:
    gemma3 = golden.loaded_of(build("gemma3_text"), "gemma3_text")  # layers 1, 3 global; 0, 2 sliding
    spec = kv_cache_spec(gemma3, BLOCK, num_blocks=10)
    kv = {"num_kv_heads": 2, "head_dim": 16}
    assert spec.groups == (FullAttention(layers=(1, 3), **kv), SlidingWindow(WINDOW, layers=(0, 2), **kv))
    assert [t.shape for t in spec.tensors] == [(2, 16), (2, 16)]  # layer j of each group shares tensor j
    layout = model_kv_layout(gemma3.model)
    assert layout.layer_tensor == (0, 0, 1, 1) and layout.layer_group == (1, 0, 1, 0)
    # One block id costs one group's layers: half of what four layers' K/V would cost.
    assert spec.bytes_per_block == 2 * 2 * (2 * 16) * 4 * BLOCK
    # gemma4: shared-KV layers own no tensor; full layers are wider (one KV head of 32) than sliding ones.
    gemma4 = model_kv_layout(build("gemma4_text"))
    assert gemma4.groups == (
        FullAttention(layers=(1,), num_kv_heads=1, head_dim=32),
        SlidingWindow(WINDOW, layers=(0,), **kv),
    )
    assert [t.shape for t in gemma4.tensors] == [(1, 32), (2, 16)] and gemma4.layer_tensor == (1, 0, 1, 0)
    llama = golden.loaded_of(build("llama"), "llama")
    assert kv_cache_spec(llama, BLOCK).groups == (FullAttention(layers=(0, 1), **kv),)
    assert kv_cache_spec(llama, BLOCK).bytes_per_block == 2 * 2 * 2 * 16 * 4 * BLOCK


def _kv_usage(metrics: Metrics) -> float:
    text = generate_latest(metrics.registry).decode()  # what GET /metrics serves
    match = re.search(r'^vllm:kv_cache_usage_perc\{model_name="tiny"\} (\S+)$', text, re.M)
    assert match is not None, text
    return float(match.group(1))


def test_a_prompt_far_past_the_window_runs_and_metrics_show_the_freed_blocks() -> None:
    (prompt,) = golden.prompts([golden.LONG], VOCAB, seed=4)
    want = golden.reference(build("gpt_oss"), prompt, 20)
    core = golden.engine(build("gpt_oss"), "gpt_oss", budget=64)
    metrics = Metrics("tiny")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    core.add_request(Request("long", prompt, params))
    tokens: list[int] = []
    used: list[int] = []
    while core.has_unfinished_requests():
        outputs = core.step()
        tokens += [t for out in outputs for t in out.new_token_ids]
        stats = core.make_stats()
        metrics.on_step(stats, IterationStats())
        if core.has_unfinished_requests():
            assert abs(_kv_usage(metrics) - stats.kv_cache_usage) < 1e-9
            used.append(round(_kv_usage(metrics) * stats.num_total_blocks))
    assert tokens == want.tokens
    full = -(-(golden.LONG + 19) // BLOCK)  # the full-attention group holds every block of the request
    window_blocks = -(-(WINDOW - 1) // BLOCK) + 1  # the sliding group: those its window still reads
    assert max(used) <= full + window_blocks + 64 // BLOCK  # a 64-token chunk may span 4 more blocks
    assert used[-1] <= full + window_blocks < 2 * full  # without freeing: 2 x 20 blocks
    assert core.make_stats().num_free_blocks == core.make_stats().num_total_blocks
    mx.clear_cache()


def test_windowed_requests_preempted_under_a_tight_pool_resume_with_the_same_tokens() -> None:
    batch = golden.prompts([120, 90, 150, 60], VOCAB, seed=7)
    model = build("gemma3_text")
    want = [golden.reference(model, p, 16) for p in batch]
    loaded = golden.loaded_of(build("gemma3_text"), "gemma3_text")
    per_block = kv_cache_spec(loaded, BLOCK).bytes_per_block
    # 30 usable blocks: one 200-token request's two groups fit (26), four 150-token requests' do not.
    from metalserve.config import EngineConfig
    from metalserve.serving.build import build_engine_core

    config = EngineConfig(
        kv_cache_memory=31 * per_block, max_model_len=200, block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=4
    )
    core = build_engine_core(config, loaded)
    got = golden.serve(core, batch, 16)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    stats = core.make_stats()
    assert stats.num_preemptions > 0 and stats.num_total_blocks == 30
    assert stats.num_free_blocks == stats.num_total_blocks


def test_the_mlx_ops_plan_gathers_only_the_pages_a_window_reads() -> None:
    import numpy as np

    from metalserve.executor.attention.mlx_ops import build_plan

    table = np.arange(1, 21)  # 20 pages: 320 slots
    plan = build_plan([table, table], np.array([0, 1, 65]), np.array([300, 300]), BLOCK, sliding_window=WINDOW)
    (decode,) = plan.decodes
    assert np.array(decode.block_ids).tolist() == [[18, 19]]  # keys 284..299 live on pages 17 and 18
    (chunk,) = plan.prefills  # queries 236..299: the oldest key any reads is 221, on page 13 (from 208)
    assert chunk.kv_slots.shape == (300 - 208,) and int(chunk.kv_slots[0]) == 14 * BLOCK


def test_the_pool_tensors_of_every_shape_grow_under_load(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from metalserve.kvcache import plan as kv_plan

    monkeypatch.setattr(kv_plan, "INITIAL_POOL_BLOCKS", 4)
    batch = golden.prompts([golden.LONG, 40], VOCAB, seed=8)
    model = build("gemma4_text")  # tensors of two shapes: (1, 32) for full layers, (2, 16) for sliding ones
    want = [golden.reference(model, p) for p in batch]
    core = golden.engine(build("gemma4_text"), "gemma4_text", budget=64)
    assert core.runner.spec.num_blocks == 4
    got = golden.serve(core, batch)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert core.runner.spec.num_blocks > 20
    assert [kv.pool.shape[1:] for kv in core.runner.kv] == [
        (1, core.runner.spec.num_slots, 32),
        (2, core.runner.spec.num_slots, 16),
    ]
