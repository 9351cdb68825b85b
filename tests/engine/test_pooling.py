"""Pooling requests in the engine: prefill only, chunked by the token budget, packed with generation
traffic in one step, blocks freed at the end; last-token / mean / CLS vectors equal a plain mlx forward's;
the prefix cache serves last-token pooling and is skipped for mean pooling."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.outputs import EngineCoreOutput
from metalserve.pooling_params import PoolingParams
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.models import golden
from tests.models.archs import VOCAB, build

ARCH = "qwen3"  # a Qwen3-Embedding-style decoder embedder, as tiny random weights


def reference(prompt: list[int], params: PoolingParams) -> np.ndarray:
    """mlx-lm's own forward over the whole prompt (final-normed hidden states), pooled by hand."""
    hidden = np.array(build(ARCH).model(mx.array(prompt)[None])[0].astype(mx.float32))
    vector = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[params.pooling_type]
    vector = vector[: params.dimensions] if params.dimensions else vector
    return vector / np.linalg.norm(vector) if params.normalize else vector


def pooling_core(budget: int = 32) -> EngineCore:
    config = EngineConfig(kv_cache_memory=1 << 22, block_size=16, max_num_batched_tokens=budget, runner="pooling")
    return build_engine_core(config, golden.loaded_of(build(ARCH), ARCH))


def drain(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    outs: dict[str, list[EngineCoreOutput]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def pooled(params: PoolingParams) -> SamplingParams:
    return SamplingParams(max_tokens=1, pooling=params)


@pytest.mark.parametrize(
    "params",
    [
        PoolingParams("last"),
        PoolingParams("mean"),
        PoolingParams("cls", normalize=False),
        PoolingParams("mean", dimensions=16),
    ],
    ids=["last", "mean", "cls-raw", "mean-matryoshka-16"],
)
def test_pooled_vectors_equal_a_plain_forward_over_chunks(params: PoolingParams) -> None:
    (prompt,) = golden.prompts([70], VOCAB, seed=3)  # 70 tokens, a 32-token budget: three chunks
    core = pooling_core()
    core.add_request(Request("e", prompt, pooled(params)))
    outs = drain(core)["e"]
    assert len(outs) == 1 and outs[0].finish_reason == "stop" and outs[0].new_token_ids == []
    got = np.array(outs[0].pooled)
    want = reference(prompt, params)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-3)
    assert core.scheduler.kv.usage == 0.0  # its blocks went back


def test_pooling_and_generation_share_a_step_and_blocks_are_freed() -> None:
    short, long = golden.prompts([9, 40], VOCAB, seed=5)
    core = pooling_core(budget=256)
    core.add_request(Request("gen", short, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    core.add_request(Request("emb", long, pooled(PoolingParams("mean"))))
    so = core.scheduler.schedule()
    assert so.num_scheduled_tokens == {"gen": 9, "emb": 40}  # one packed step
    outputs = core.scheduler.update_from_output(so, core.runner.execute_model(so))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["emb"].pooled is not None and by_id["emb"].finished
    assert len(by_id["gen"].new_token_ids) == 1 and not by_id["gen"].finished
    np.testing.assert_allclose(by_id["emb"].pooled, reference(long, PoolingParams("mean")), atol=2e-4)
    rest = drain(core)
    assert sum(len(o.new_token_ids) for o in rest["gen"]) == 3 and rest["gen"][-1].finished
    assert core.scheduler.kv.usage == 0.0


def test_prefix_cache_serves_last_token_pooling_not_mean() -> None:
    (base,) = golden.prompts([64], VOCAB, seed=7)
    core = pooling_core(budget=128)
    for rid, params in [
        ("warm", PoolingParams("last")),
        ("hit", PoolingParams("last")),
        ("mean", PoolingParams("mean")),
    ]:
        prompt = base + [len(rid), 2, 3]  # 3 tokens after 4 shared full blocks
        core.add_request(Request(rid, prompt, pooled(params)))
        (out,) = drain(core)[rid]
        assert out.pooled is not None
        np.testing.assert_allclose(out.pooled, reference(prompt, params), atol=2e-4, rtol=1e-3)
        expected_cached = {"warm": 0, "hit": 64, "mean": 0}[rid]
        assert out.num_cached_tokens == expected_cached


def test_a_generating_model_refuses_pooling_requests() -> None:
    config = EngineConfig(kv_cache_memory=1 << 22, block_size=16)
    core = build_engine_core(config, golden.loaded_of(build(ARCH), ARCH))
    assert core.pooling is None
    with pytest.raises(ValueError, match="not started as a pooling model"):
        core.add_request(Request("e", [1, 2, 3], pooled(PoolingParams("last"))))


def test_pooling_params_are_checked() -> None:
    with pytest.raises(ValueError, match="generates no tokens"):
        SamplingParams(max_tokens=4, pooling=PoolingParams())
    with pytest.raises(ValueError, match="pooling type"):
        PoolingParams("max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)


def test_async_scheduling_never_schedules_a_token_after_a_pooled_prompt() -> None:
    short, long = golden.prompts([9, 40], VOCAB, seed=5)
    config = EngineConfig(
        kv_cache_memory=1 << 22, block_size=16, max_num_batched_tokens=32, runner="pooling", async_scheduling=True
    )
    core = build_engine_core(config, golden.loaded_of(build(ARCH), ARCH))
    assert core.async_scheduling
    core.add_request(Request("gen", short, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    core.add_request(Request("emb", long, pooled(PoolingParams("mean"))))
    outs = drain(core)
    (emb,) = outs["emb"]
    np.testing.assert_allclose(emb.pooled, reference(long, PoolingParams("mean")), atol=2e-4)
    assert sum(len(o.new_token_ids) for o in outs["gen"]) == 4
    assert core.scheduler.num_placeholders == 3  # the generating request's only: none for the pooled prompt
    assert core.scheduler.kv.usage == 0.0
