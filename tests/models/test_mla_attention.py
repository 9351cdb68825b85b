"""MLA's latent pages through the attention seam: one pool plane, V the first value_dim channels of K."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from metalserve.config import ConfigError
from metalserve.executor.attention import mlx_ops
from metalserve.executor.attention.base import AttentionBackend, AttentionCall, AttentionOptions, LayerCacheSpec
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.metal import KernelAttention
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.attention.select import select_attention
from metalserve.executor.step_inputs import StepInputs
from metalserve.kernels.cpu import attention as cpu_attention
from metalserve.kvcache.specs import MLALatent
from metalserve.platform import Platform
from tests.models.mla_golden import TINY_MLA

CPU_ONLY = Platform(on_cpu=True, metal=False, numba=True, blas="test")
MAC = Platform(on_cpu=False, metal=True, numba=True, blas="test", metal_memory=1 << 34)
RANK, WIDTH, HEADS, BLOCK, SCALE = 32, 40, 4, 8, 0.25
LATENT = LayerCacheSpec(MLALatent(num_kv_heads=1, head_dim=WIDTH, value_dim=RANK), BLOCK, num_blocks=16)
OPTIONS = AttentionOptions(scale=SCALE, value_dim=RANK)


def naive(q: np.ndarray, keys: np.ndarray, first_pos: int) -> np.ndarray:
    """float64, causal: each query row at `first_pos + i` attends softmax(q . K) @ K[:, :RANK]."""
    out = []
    for i, row in enumerate(q.astype(np.float64)):
        k = keys[: first_pos + i + 1].astype(np.float64)
        s = row @ k.T * SCALE  # [H, L]
        p = np.exp(s - s.max(-1, keepdims=True))
        out.append((p / p.sum(-1, keepdims=True)) @ k[:, :RANK])
    return np.stack(out)


def step_of(tables: list[np.ndarray], starts: list[int], ends: list[int]) -> StepInputs:
    """Each request's tokens `start..end-1` this step (single-query requests first, as pack_step lays out)."""
    pos = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
    req = np.repeat(np.arange(len(tables)), [b - a for a, b in zip(starts, ends, strict=True)])
    slots = np.array([tables[r][p // BLOCK] * BLOCK + p % BLOCK for r, p in zip(req, pos, strict=True)], np.int32)
    cu = np.concatenate([[0], np.cumsum([b - a for a, b in zip(starts, ends, strict=True)])]).astype(np.int32)
    return StepInputs(
        [f"r{i}" for i in range(len(tables))],
        np.zeros(len(pos), np.int32),
        pos.astype(np.int32),
        slots,
        cu,
        np.array(ends, np.int32),
        tables,
        [],
        np.zeros(0, np.int32),
    )


@pytest.mark.parametrize("backend", [MlxAttention(), CpuAttention()], ids=["mlx", "cpu"])
def test_latent_pages_attend_as_mqa_with_v_the_latent(backend: AttentionBackend) -> None:  # type: ignore[type-arg]
    """A prefill of two requests, then a decode and a chunk over their cached pages, equal float64 math."""
    rng = np.random.default_rng(0)
    lengths, tables = [13, 29], [np.array([3, 1], np.int32), np.array([5, 2, 9, 4], np.int32)]
    keys = [rng.standard_normal((n, WIDTH)).astype(np.float32) for n in lengths]
    cache = backend.allocate(LATENT)
    for starts, ends in (([0, 0], [12, 24]), ([12, 24], [13, 29])):  # then: r0 decodes, r1 prefills 5 more
        step = step_of(tables, starts, ends)
        q = rng.standard_normal((len(step.positions), HEADS, WIDTH)).astype(np.float32)
        k = np.concatenate([kk[a:b] for kk, a, b in zip(keys, starts, ends, strict=True)])[:, None]
        meta = backend.build_metadata(step, LATENT)
        call = AttentionCall(mx.array(q), mx.array(k), None, mx.array(step.slot_mapping), cache, meta, OPTIONS)
        got = np.array(backend.forward(call))
        want = np.concatenate(
            [naive(q[step.cu_seqlens_q[i] : step.cu_seqlens_q[i + 1]], keys[i], starts[i]) for i in range(2)]
        )
        assert got.shape == (len(q), HEADS, RANK)
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_latent_pool_holds_one_plane_and_refuses_k_and_v() -> None:
    pool = MlxAttention().allocate(LATENT).pool
    assert pool.shape == (1, 1, LATENT.num_slots, WIDTH) and LATENT.num_planes == 1
    k = mx.zeros((2, 1, WIDTH))
    with pytest.raises(ValueError, match="planes"):
        mlx_ops.write_kv_portable(pool, k, k, mx.array([0, 1]))
    with pytest.raises(ValueError, match="planes"):
        cpu_attention.write_kv(
            np.zeros((2, 1, 16, WIDTH), np.float32), np.zeros((2, 1, WIDTH), np.float32), None, np.array([0, 1])
        )
    plan = mlx_ops.build_plan([np.array([1])], np.array([0, 1]), np.array([1]), BLOCK)
    with pytest.raises(ValueError, match="latent"):  # a latent pool read as K and V
        mlx_ops.paged_attention_planned(mx.zeros((1, HEADS, WIDTH)), pool, plan, AttentionOptions(SCALE))


def test_the_metal_kernel_is_never_chosen_for_latent_pages(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        assert isinstance(select_attention("auto", mx.float32, MAC, latent_kv=True), MlxAttention)
    assert "Metal kernel has no MLA latent layout" in caplog.text
    assert isinstance(select_attention("auto", mx.float32, MAC), KernelAttention)  # other models keep it
    assert isinstance(select_attention("auto", mx.float32, CPU_ONLY, latent_kv=True), CpuAttention)
    with pytest.raises(ConfigError, match="latent"):
        select_attention("metal", mx.float32, MAC, latent_kv=True)
    with pytest.raises(ValueError, match="latent"):
        KernelAttention(mlx_ops.paged_attention).allocate(LATENT)


def test_yarn_rope_rotates_each_packed_token_at_its_own_position() -> None:
    """The RoPE mlx-lm builds for DeepSeek (YaRN, mscale, traditional) with an array of offsets."""
    rope = initialize_rope(
        TINY_MLA["qk_rope_head_dim"],
        base=10000.0,
        traditional=True,
        max_position_embeddings=1024,
        scaling_config=TINY_MLA["rope_scaling"],
    )
    assert type(rope).__name__ == "YarnRoPE" and rope.mscale != 1.0
    x = mx.random.normal((5, HEADS + 1, 1, 8), key=mx.random.key(0))
    positions = [0, 7, 300, 3, 1000]
    packed = rope(x, offset=mx.array(positions))
    for i, p in enumerate(positions):  # mlx-lm's own call: one sequence of one token at offset p
        alone = rope(x[i : i + 1].transpose(2, 1, 0, 3), offset=p).transpose(2, 1, 0, 3)
        np.testing.assert_allclose(np.array(packed[i : i + 1]), np.array(alone), atol=1e-6)


def test_a_quantized_kv_b_splits_into_the_absorbed_halves_of_its_dequantized_weight() -> None:
    """deepseek_v2 keeps kv_b whole; a 4-bit one is dequantized, then cut into embed_q and unembed_out."""
    from mlx_lm.models import deepseek_v2

    from metalserve.executor.models.mla import split_kv_b

    args = deepseek_v2.ModelArgs.from_dict({**TINY_MLA, "qk_nope_head_dim": 32, "v_head_dim": 32})
    attn = deepseek_v2.DeepseekV2Attention(args)
    attn.kv_b_proj = nn.QuantizedLinear.from_linear(attn.kv_b_proj, group_size=32, bits=4)
    dense = mx.dequantize(attn.kv_b_proj.weight, attn.kv_b_proj.scales, attn.kv_b_proj.biases, 32, 4)
    split_kv_b(attn)
    assert "kv_b_proj" not in attn
    latent = mx.random.normal((3, RANK), key=mx.random.key(1))
    want = (latent @ dense.T).reshape(3, HEADS, 64)  # per head: nope K rows, then V rows
    k_nope = attn.embed_q(latent[None], transpose=False).swapaxes(0, 1)  # [3, H, nope]
    values = attn.unembed_out(latent[None]).swapaxes(0, 1)  # [3, H, v]
    np.testing.assert_allclose(np.array(k_nope), np.array(want[..., :32]), atol=1e-5)
    np.testing.assert_allclose(np.array(values), np.array(want[..., 32:]), atol=1e-5)
