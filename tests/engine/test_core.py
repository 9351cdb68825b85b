"""The engine core joins scheduler, KV manager and runner: outputs equal mlx-lm greedy, even under pressure."""

from __future__ import annotations

import pytest

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.executor.runner import ModelRunner
from metalserve.kvcache import plan as kv_plan
from metalserve.loader import LoadedModel
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import SchedulerOutput
from metalserve.serving.build import build_engine_core
from metalserve.serving.parts import COMPILE_WARMUP_TOKENS
from tests.executor.test_runner_golden import mlx_lm_greedy, prompts_of
from tests.executor.tiny_models import tiny_model


def tiny_loaded(seed: int = 0) -> LoadedModel:
    model = tiny_model("llama", seed=seed)
    return LoadedModel(
        model=model,
        tokenizer=None,
        model_type="llama",
        config={},
        max_model_len=256,  # type: ignore[arg-type]
        eos_token_ids=frozenset(),
        chat_template=None,
        source="tiny",
        weights_desc="fp32",
        blas_desc="-",
    )


def run_all(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, list[int]], int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    most_waiting = 0
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
        most_waiting = max(most_waiting, core.make_stats().num_waiting)
    return got, most_waiting


def test_core_matches_mlx_lm_greedy() -> None:
    loaded = tiny_loaded()
    prompts = prompts_of([12, 40, 3, 25], loaded.model.args.vocab_size, seed=5)
    expected = [mlx_lm_greedy(loaded.model, p, 16) for p in prompts]
    config = EngineConfig(kv_cache_memory=1 << 22, max_num_batched_tokens=32, block_size=8)
    core = build_engine_core(config, loaded)
    got, _ = run_all(core, prompts, 16)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    stats = core.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_the_warm_up_step_measures_a_full_step_or_with_a_kv_budget_compiles_on_a_short_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a budget the warm-up is a full-size step (its peak sizes the pool); with one, a short step
    still runs so the kernels compile at start-up instead of in the first request."""
    steps: list[int] = []
    execute = ModelRunner.execute_model

    def recording(runner: ModelRunner, out: SchedulerOutput) -> object:
        steps.append(out.total_num_scheduled_tokens)
        return execute(runner, out)

    monkeypatch.setattr(ModelRunner, "execute_model", recording)
    build_engine_core(EngineConfig(max_num_batched_tokens=128, block_size=8), tiny_loaded())
    assert steps == [128]
    steps.clear()
    build_engine_core(EngineConfig(kv_cache_memory=1 << 22, max_num_batched_tokens=128, block_size=8), tiny_loaded())
    assert steps == [COMPILE_WARMUP_TOKENS] and COMPILE_WARMUP_TOKENS < 128
    steps.clear()
    build_engine_core(EngineConfig(kv_cache_memory=1 << 22, max_num_batched_tokens=32, block_size=8), tiny_loaded())
    assert steps == [32]  # never longer than a step may be


def test_a_pool_too_small_for_all_requests_preempts_or_queues_and_stays_correct() -> None:
    loaded = tiny_loaded()
    prompts = prompts_of([30] * 8, loaded.model.args.vocab_size, seed=6)
    expected = [mlx_lm_greedy(loaded.model, p, 24) for p in prompts]
    per_block = 2 * 2 * 2 * 16 * 4 * 8  # layers * (K, V) * kv heads * head_dim * fp32 * block size
    # 40 usable blocks of 8 tokens: enough for max_model_len, far from 8 x 54 tokens at once.
    config = EngineConfig(kv_cache_memory=41 * per_block, max_model_len=256, block_size=8, max_num_batched_tokens=64)
    core = build_engine_core(config, loaded)
    got, most_waiting = run_all(core, prompts, 24)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert most_waiting > 0 or core.make_stats().num_preemptions > 0
    stats = core.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("backend", ["mlx", "cpu"])
def test_the_pool_grows_under_load_and_outputs_stay_exact(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setattr(kv_plan, "INITIAL_POOL_BLOCKS", 4)
    loaded = tiny_loaded()
    prompts = prompts_of([30, 45, 12, 60, 33, 20], loaded.model.args.vocab_size, seed=9)
    expected = [mlx_lm_greedy(loaded.model, p, 20) for p in prompts]
    config = EngineConfig(
        kv_cache_memory=1 << 22,
        block_size=8,
        max_num_batched_tokens=64,
        attention_backend=backend,  # type: ignore[arg-type]
    )
    core = build_engine_core(config, loaded)
    assert core.runner.spec.num_blocks == 4
    got, _ = run_all(core, prompts, 20)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    grown = core.scheduler.kv.pool.num_allocated_blocks
    assert core.runner.spec.num_blocks == grown > 4 and grown < core.scheduler.kv.pool.num_blocks


@pytest.mark.parametrize("backend", ["mlx", "cpu"])
def test_a_growing_pool_copies_one_tensor_at_a_time(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Growing the pool keeps at most one old tensor (and its zeros) beside the new pool: evaluated all at
    once, the whole old pool and as many zeros stood beside the new one."""
    import mlx.core as mx

    monkeypatch.setattr(kv_plan, "INITIAL_POOL_BLOCKS", 64)
    config = EngineConfig(kv_cache_memory=1 << 24, block_size=8, attention_backend=backend)  # type: ignore[arg-type]
    runner = build_engine_core(config, tiny_loaded()).runner
    assert isinstance(runner, ModelRunner)
    mx.clear_cache()
    before = mx.get_active_memory()
    old_pool = sum(a.nbytes for layer in runner.kv for a in layer.arrays())
    largest = max(sum(a.nbytes for a in layer.arrays()) for layer in runner.kv)
    mx.reset_peak_memory()
    runner.grow_kv(128)
    assert sum(a.nbytes for layer in runner.kv for a in layer.arrays()) == 2 * old_pool
    # The grown tensors' rise, and the last one's old buffer and zeros beside its new one (4 KiB: small
    # arrays). All at once, the rise was 2.5 to 3 times the old pool.
    assert mx.get_peak_memory() - before <= old_pool + 2 * largest + 4096


def test_the_pool_is_capped_at_what_max_num_seqs_requests_can_use() -> None:
    loaded = tiny_loaded()
    config = EngineConfig(kv_cache_memory=1 << 24, block_size=8, max_num_seqs=2, max_model_len=64)
    core = build_engine_core(config, loaded)
    assert core.scheduler.kv.pool.num_blocks == 2 * 8 + 1
