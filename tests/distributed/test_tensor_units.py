"""Tensor parallelism's parts in one process: the flag's refusals, which models split and why not, the
split itself (each rank's heads, KV pool and partial sums add up to the whole layer), and the step's
broadcast encoding. Fake groups stand in for the ranks: mlx-lm's shard reads only `rank()` and `size()`."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.distributed.handshake import RankReport, StartupError, check_reports
from metalserve.distributed.shard import AllSum, TensorParallelError, shard_model, tp_problem
from metalserve.distributed.tensor import decode_step, encode_step
from metalserve.distributed.wire import Header, Kind
from metalserve.executor.models.families import model_family
from metalserve.executor.step_inputs import StepInputs
from metalserve.kvcache.specs import KVCacheDtype
from tests.executor.tiny_models import tiny_model
from tests.models.archs import build


class FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _shards(make: object, size: int = 2) -> list[nn.Module]:
    models = []
    for rank in range(size):
        model = make()  # type: ignore[operator]
        shard_model(model, FakeGroup(rank, size))  # type: ignore[arg-type]
        # A real (one-process) group in the all-reduces, so a forward can be built (a hybrid's state probe).
        for _, module in model.named_modules():
            if isinstance(module, AllSum):
                module.group = mx.distributed.init()
        models.append(model)
    return models


def test_flag_refusals_are_clear() -> None:
    from metalserve.speculative_config import SpeculativeConfig

    assert EngineConfig(tensor_parallel_size=2).world_size == 2
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2).world_size == 4  # TP inside stages
    with pytest.raises(ConfigError, match="--speculative-config does not work with --tensor-parallel-size"):
        EngineConfig(tensor_parallel_size=2, speculative_config=SpeculativeConfig("ngram", 3, 1, 5))
    with pytest.raises(ConfigError, match="--enable-lora does not work with --tensor-parallel-size"):
        EngineConfig(tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(
        ConfigError,
        match="--kv-disk-dir does not work with --tensor-parallel-size > 1 yet: each rank would have to save",
    ):
        EngineConfig(tensor_parallel_size=2, kv_disk_dir="/tmp/x")


def test_cli_takes_vllms_flag_and_its_short_form() -> None:
    from metalserve.cli import build_parser
    from metalserve.flags import build, flag_values

    for argv in (["serve", "--tensor-parallel-size", "2"], ["serve", "-tp", "2"]):
        args = build_parser().parse_args(argv)
        assert build(EngineConfig, flag_values(args, EngineConfig)).tensor_parallel_size == 2


def test_which_models_split_and_why_not() -> None:
    llama = tiny_model("llama")  # 4 heads, 2 KV heads, 128 MLP columns
    assert tp_problem(llama, 2) is None
    assert tp_problem(llama, 3) == "layer 0 has 4 attention heads, not divisible by 3"
    assert tp_problem(llama, 4) == "layer 0 has 2 KV heads, not divisible by 4"
    odd = tiny_model("llama", num_attention_heads=2, num_key_value_heads=2, intermediate_size=100)
    assert tp_problem(odd, 2) is None
    assert tp_problem(odd, 8) == "layer 0 has 2 attention heads, not divisible by 8"
    assert "MLP has 102 intermediate columns, not divisible by 4" in str(
        tp_problem(tiny_model("llama", num_attention_heads=4, num_key_value_heads=4, intermediate_size=102), 4)
    )
    assert tp_problem(build("gemma3_text"), 2) is None
    assert tp_problem(build("gemma2"), 2) == (
        "a gemma2 model: tensor parallelism serves llama, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_moe, "
        "gemma3_text models so far"
    )
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 3: layer 0 has 4 attention heads"):
        shard_model(tiny_model("llama"), FakeGroup(0, 3))  # type: ignore[arg-type]


def test_each_rank_keeps_its_heads_and_its_pool_holds_them() -> None:
    whole = tiny_model("llama", seed=3)
    ranks = _shards(lambda: tiny_model("llama", seed=3))
    for model in ranks:
        attn = model.model.layers[0].self_attn
        assert (attn.n_heads, attn.n_kv_heads) == (2, 1)
        assert isinstance(attn.q_proj, nn.Linear) and attn.q_proj.weight.shape == (32, 64)  # 2 heads of 16
        assert isinstance(attn.o_proj, AllSum) and isinstance(model.model.layers[0].mlp.down_proj, AllSum)
    family = model_family("llama")
    full = family.kv_cache_spec(whole, 8, KVCacheDtype.AUTO)
    half = family.kv_cache_spec(ranks[1], 8, KVCacheDtype.AUTO)
    assert half.tensors[0].num_kv_heads == 1 and full.tensors[0].num_kv_heads == 2
    assert 2 * half.bytes_per_block == full.bytes_per_block
    # Rank 1 holds the second KV head: its K rows are the whole layer's second half.
    k_whole = whole.model.layers[0].self_attn.k_proj.weight
    assert mx.array_equal(ranks[1].model.layers[0].self_attn.k_proj.weight, k_whole[16:])


def _partial(layer_part: nn.Module, x: mx.array, attention: bool) -> mx.array:
    """One rank's contribution before the all-reduce: the row-parallel projection's inner layer."""
    if attention:
        reduce = layer_part.o_proj
        layer_part.o_proj = reduce.inner
        try:
            return layer_part(x, mask="causal")
        finally:
            layer_part.o_proj = reduce
    reduce = layer_part.down_proj
    layer_part.down_proj = reduce.inner
    try:
        return layer_part(x)
    finally:
        layer_part.down_proj = reduce


def _tiny(model_type: str, seed: int) -> nn.Module:
    return build(model_type, seed=seed) if model_type == "gemma3_text" else tiny_model(model_type, seed=seed)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_rank_partials_sum_to_the_whole_layer(model_type: str) -> None:
    """Attention (GQA: each rank's query heads read its own KV head) and MLP split exactly; gemma3_text
    (split here: mlx-lm has no `shard` for it) with its q/k norms."""
    whole = _tiny(model_type, 4)
    ranks = _shards(lambda: _tiny(model_type, 4))
    x = mx.random.normal((1, 6, 64), key=mx.random.key(0))
    layer = whole.model.layers[1]
    want_attn = layer.self_attn(x, mask="causal")
    got_attn = sum(_partial(r.model.layers[1].self_attn, x, True) for r in ranks)
    assert mx.allclose(got_attn, want_attn, atol=1e-4).item()  # type: ignore[union-attr]
    got_mlp = sum(_partial(r.model.layers[1].mlp, x, False) for r in ranks)
    assert mx.allclose(got_mlp, layer.mlp(x), atol=1e-4).item()  # type: ignore[union-attr]


def test_moe_experts_split_by_column() -> None:
    """qwen3_moe: every rank keeps every expert and the router, with half of each expert's columns."""
    whole = build("qwen3_moe", seed=2)
    ranks = _shards(lambda: build("qwen3_moe", seed=2))
    moe = ranks[0].model.layers[0].mlp
    assert isinstance(moe, AllSum) and moe.inner.sharding_group is None
    experts, columns, _ = whole.model.layers[0].mlp.switch_mlp.gate_proj.weight.shape
    assert moe.inner.switch_mlp.gate_proj.weight.shape[:2] == (experts, columns // 2)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(1))
    got = sum(r.model.layers[0].mlp.inner(x) for r in ranks)
    assert mx.allclose(got, whole.model.layers[0].mlp(x), atol=1e-4).item()  # type: ignore[union-attr]


def test_step_broadcast_round_trip() -> None:
    step = StepInputs(
        ["a", "b"],
        np.array([5, 6, 7, 8, 9], np.int32),
        np.array([0, 1, 2, 3, 16], np.int32),
        np.array([8, 9, 10, 11, 40], np.int32),
        np.array([0, 4, 5], np.int32),
        np.array([4, 17], np.int32),
        [np.array([1]), np.array([2, 3, 5])],
        [0, 1],
        np.array([3, 4], np.int32),
    )
    # A second layer group's tables (a hybrid's recurrent-state group) travel with the step.
    states = [np.array([7]), np.array([8, 9])]
    flat, width = encode_step(step, (states,))
    header = Header(Kind.STEP, 5, 2, 2, width, 64, 0, flat.nbytes, 2)
    token_ids, meta = decode_step(flat, header)
    back = meta.step_inputs()
    assert token_ids.tolist() == [5, 6, 7, 8, 9] and back.positions.tolist() == [0, 1, 2, 3, 16]
    assert back.padded_block_tables().tolist() == [[1, 0, 0], [2, 3, 5]]
    assert back.slot_mapping.tolist() == step.slot_mapping.tolist()
    assert [r.tolist() for r in meta.group_rows[0]] == [[7], [8, 9]]


class RingWorld(FakeGroup):
    """A world group whose backend cannot split (MLX's ring)."""

    def split(self, color: int, key: int) -> None:
        raise RuntimeError("[ring] Group split not supported")


def test_a_stages_pair_sums_over_send_recv_where_the_backend_cannot_split() -> None:
    from metalserve.distributed.subgroup import PairGroup, stage_tensor_group

    pair = stage_tensor_group(RingWorld(3, 4), 2)  # type: ignore[arg-type]
    assert isinstance(pair, PairGroup) and pair.members == (2, 3) and (pair.rank(), pair.partner) == (1, 2)
    assert stage_tensor_group(RingWorld(0, 4), 2).members == (0, 1)  # type: ignore[arg-type,union-attr]
    with pytest.raises(ConfigError, match="cannot split the group .*serves 2 ranks"):
        stage_tensor_group(RingWorld(0, 6), 3)  # type: ignore[arg-type]
    # A stage's ranks hold the same layers; stages follow each other.
    ok = RankReport(True, (1,) * 8, 10, range(0, 2), 1, 4096, "", 16)
    stages = [ok, ok, ok._replace(layers=range(2, 4)), ok._replace(layers=range(2, 4))]
    check_reports(stages, tp=2)
    with pytest.raises(StartupError, match="ranks 2 and 3 \\(one stage\\) disagree on the layer split"):
        check_reports([*stages[:3], ok._replace(layers=range(3, 4))], tp=2)


def test_reports_name_tensor_parallel_ranks() -> None:
    ok = RankReport(True, (1,) * 8, 10, range(0, 1), 1, 4096, "", 16)
    with pytest.raises(StartupError, match="tensor-parallel rank 1 could not start: boom"):
        check_reports([ok, RankReport.failed("boom")], role="tensor-parallel")
    check_reports([ok, ok._replace(layers=range(1, 2))], role="tensor-parallel")


def _quantized_llama() -> nn.Module:
    model = tiny_model("llama", seed=6)
    nn.quantize(model, group_size=32, bits=4)
    return model


def test_quantized_layers_split_while_packed() -> None:
    """4-bit layers stay packed: column-parallel ones as QuantizedLinear of this rank's rows, row-parallel
    ones inside the all-reduce, their groups whole; the partial sums add up to the whole layer."""
    whole = _quantized_llama()
    ranks = _shards(_quantized_llama)
    attn = ranks[0].model.layers[0].self_attn
    assert type(attn.q_proj) is nn.QuantizedLinear and type(attn.o_proj.inner) is nn.QuantizedLinear
    x = mx.random.normal((1, 4, 64), key=mx.random.key(2))
    got = sum(_partial(r.model.layers[0].mlp, x, False) for r in ranks)
    assert mx.allclose(got, whole.model.layers[0].mlp(x), atol=1e-3).item()  # type: ignore[union-attr]
    # 64 input columns of o_proj split over 4 ranks leave 16 each: not whole groups of 32.
    wide = tiny_model("llama", seed=6, num_attention_heads=4, num_key_value_heads=4)
    nn.quantize(wide, group_size=32, bits=4)
    assert tp_problem(wide, 4) == (
        "layer 0's o_proj: 64 quantized input columns do not split into whole groups of 32 over 4"
    )


def test_split_models_of_several_groups_pass_the_layout_check() -> None:
    """Sliding windows and recurrent states: every rank builds every group's metadata (Stage.context)."""
    from metalserve.executor.models.adapter import PagedModel
    from metalserve.serving.tensor import check_tensor_parallel_layout
    from tests.models.hybrid_tiny import tiny_hybrid
    from tests.models.mla_golden import tiny_mla

    windowed = _shards(
        lambda: tiny_model("llama", layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    )
    check_tensor_parallel_layout(PagedModel(windowed[0], "llama"), "llama")
    check_tensor_parallel_layout(PagedModel(_shards(lambda: tiny_hybrid("qwen3_5", seed=11))[1], "qwen3_5"), "qwen3_5")
    mla = PagedModel(tiny_mla("deepseek_v3", seed=8), "deepseek_v3")
    with pytest.raises(TensorParallelError, match="MLA latent pages"):
        check_tensor_parallel_layout(mla, "deepseek_v3")


def _delta_partial(la: nn.Module, x: mx.array, cache: object) -> mx.array:
    """One rank's gated delta net before its all-reduce (out_proj's inner layer)."""
    reduce = la.out_proj
    la.out_proj = reduce.inner
    try:
        return la(x, None, cache)
    finally:
        la.out_proj = reduce


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_a_hybrids_recurrent_heads_split_with_their_states(model_type: str) -> None:
    """qwen3_5: each rank's gated delta net keeps its key/value heads (conv channels, A_log, dt_bias) and
    its own recurrent state; the ranks' partials sum to the whole layer over a prefill and a decode step
    that reads the state back. Attention and MLP split as llama's; the untied head stays whole."""
    from mlx_lm.models.cache import ArraysCache

    from metalserve.executor.models.adapter import PagedModel
    from tests.models.hybrid_tiny import tiny_hybrid

    whole = tiny_hybrid(model_type, seed=11)
    ranks = _shards(lambda: tiny_hybrid(model_type, seed=11))
    layers = [r.language_model.model.layers for r in ranks]
    la = layers[0][0].linear_attn
    assert (la.num_k_heads, la.num_v_heads) == (1, 2) and isinstance(la.out_proj, AllSum)
    assert la.sharding_group is None and isinstance(layers[0][1].self_attn.o_proj, AllSum)
    head = whole.language_model.lm_head.weight
    assert ranks[1].language_model.lm_head.weight.shape == head.shape
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    step = mx.random.normal((1, 1, 64), key=mx.random.key(3))
    ref_cache = ArraysCache(2)
    ref = whole.language_model.model.layers[0].linear_attn
    want = [ref(x, None, ref_cache), ref(step, None, ref_cache)]
    caches = [ArraysCache(2) for _ in ranks]
    for i, inp in enumerate((x, step)):
        got = sum(_delta_partial(ls[0].linear_attn, inp, c) for ls, c in zip(layers, caches, strict=True))
        assert mx.allclose(got, want[i], atol=1e-4).item()  # type: ignore[union-attr]
    mlp = whole.language_model.model.layers[1].mlp
    if model_type == "qwen3_5":
        got_mlp = sum(_partial(ls[1].mlp, x, False) for ls in layers)
    else:
        got_mlp = sum(ls[1].mlp.inner(x) for ls in layers)
    assert mx.allclose(got_mlp, mlp(x), atol=1e-4).item()  # type: ignore[union-attr]
    # Last (PagedModel wraps the mixers in place): each rank's state slots hold its heads, half the bytes.
    whole_state = PagedModel(whole, model_type).state_layout
    rank_state = PagedModel(ranks[1], model_type).state_layout
    assert whole_state is not None and rank_state is not None
    assert 2 * rank_state.slot_bytes == whole_state.slot_bytes


def test_watchdog_names_tensor_parallel_ranks() -> None:
    import subprocess
    import sys
    import time

    from metalserve.distributed.watchdog import Watchdog

    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.wait(30)
    assert Watchdog([child], 60, lambda: None, role="tensor-parallel").check() == (
        "tensor-parallel rank 1 exited with status 3"
    )
    since = time.monotonic() - 5
    problem = Watchdog([], 2, lambda: since, role="tensor-parallel").check()
    assert problem is not None and "no result from the tensor-parallel ranks for 2 s" in problem
