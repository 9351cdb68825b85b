"""DeepSeek V3 (and GLM-4 MoE Lite) served by the real engine over latent pages equal mlx-lm's generation."""

from __future__ import annotations

import pytest

from metalserve.config import EngineConfig
from metalserve.executor.models.families import kv_cache_spec, kv_shape
from metalserve.executor.models.mla import PagedMLA
from metalserve.generate import generate_config
from metalserve.kvcache.plan import plan_kv_pool, pool_budget
from metalserve.kvcache.specs import MLALatent
from tests.models.mla_golden import (
    Greedy,
    assert_matches,
    engine_greedy,
    loaded_of,
    make_core,
    mlx_lm_greedy,
    prompts_of,
    tiny_mla,
)

NUM_TOKENS = 24
# glm4_moe_lite: the same MLA module with an un-LoRA'd query and plain RoPE.
GLM: dict[str, object] = dict(q_lora_rank=None, rope_scaling=None, n_group=1)
# deepseek_v2: kv_b whole (split into the absorbed halves at install), its own YaRN class, softmax router.
V2: dict[str, object] = dict(topk_method="group_limited_greedy")


@pytest.fixture(scope="module")
def deepseek() -> tuple[list[list[int]], list[Greedy]]:
    """A short and a 300-token prompt and mlx-lm's own greedy generation for each."""
    model = tiny_mla()
    prompts = prompts_of([21, 300], model.args.vocab_size)
    return prompts, [mlx_lm_greedy(model, p, NUM_TOKENS) for p in prompts]


@pytest.mark.parametrize("backend", ["auto", "mlx"])
def test_a_short_prompt_matches_mlx_lm(deepseek: tuple[list[list[int]], list[Greedy]], backend: str) -> None:
    """`auto` is the numba CPU backend on this machine; `mlx` the MLX-ops backend."""
    prompts, want = deepseek
    core = make_core(tiny_mla(), "deepseek_v3", backend=backend)
    assert all(isinstance(layer.self_attn, PagedMLA) for layer in core.runner.model.backbone.layers)
    (got,) = engine_greedy(core, prompts[:1], NUM_TOKENS)
    assert_matches(got, want[0])


@pytest.mark.parametrize(("model_type", "overrides"), [("glm4_moe_lite", GLM), ("deepseek_v2", V2)])
def test_the_other_mla_families_match_mlx_lm(model_type: str, overrides: dict[str, object]) -> None:
    model = tiny_mla(model_type, **overrides)
    (prompt,) = prompts_of([19], model.args.vocab_size, seed=3)
    want = mlx_lm_greedy(model, prompt, NUM_TOKENS)
    core = make_core(tiny_mla(model_type, **overrides), model_type)
    assert all(isinstance(layer.self_attn, PagedMLA) for layer in core.runner.model.backbone.layers)
    (got,) = engine_greedy(core, [prompt], NUM_TOKENS)
    assert_matches(got, want)


def test_the_kv_cache_counts_the_latent_alone() -> None:
    """One token of one layer keeps kv_lora + rope values (40), not 2 x heads x head dims (4 x (24 + 16))."""
    loaded = loaded_of(tiny_mla(), "deepseek_v3")
    assert kv_shape(loaded)[:4] == (3, 1, 40, 32)
    spec = kv_cache_spec(loaded, block_size=16, num_blocks=8)
    assert spec.bytes_per_block == 3 * 40 * 4 * 16
    assert spec.tensors[0] == MLALatent(num_kv_heads=1, head_dim=40, value_dim=32)
    config = EngineConfig(kv_cache_memory=100 * spec.bytes_per_block, block_size=16, max_num_seqs=1000)
    assert plan_kv_pool(config, spec, 1024, pool_budget(config, None, 0)).num_blocks == 100
    sized = generate_config(loaded, 2, EngineConfig(block_size=16, max_model_len=160))
    assert sized.kv_cache_memory == (2 * 10 + 1) * spec.bytes_per_block  # room for both prompts, + the null block
    # every MLA layer attends over all its pages, which keep the model's dtype under int8
    assert spec.groups == (MLALatent(layers=(0, 1, 2), num_kv_heads=1, head_dim=40, value_dim=32),)
    assert kv_cache_spec(loaded, 16, "int8").bytes_per_block == spec.bytes_per_block
    core = make_core(tiny_mla(), "deepseek_v3")
    assert core.runner.kv[0].arrays()[0].shape[:2] == (1, 1)  # one plane, one latent "head"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "mlx"])
def test_long_batched_chunked_and_prefix_cached(deepseek: tuple[list[list[int]], list[Greedy]], backend: str) -> None:
    """The 300-token prompt alone; then with the short one in a 64-token budget (chunked prefill beside
    decodes); then both again, now from the prefix cache."""
    prompts, want = deepseek
    (alone,) = engine_greedy(make_core(tiny_mla(), "deepseek_v3", backend=backend), prompts[1:], NUM_TOKENS)
    assert_matches(alone, want[1])
    core = make_core(tiny_mla(), "deepseek_v3", budget=64, backend=backend)
    for tag in ("cold", "warm"):
        got = engine_greedy(core, prompts, NUM_TOKENS, tag=tag)
        for g, w in zip(got, want, strict=True):
            assert_matches(g, w)
        if tag == "warm":
            assert got[1].cached >= 288 and got[0].cached >= 16  # whole blocks of each prompt were hits
