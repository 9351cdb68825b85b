"""Every supported ggml type reads back as the `gguf` package's own dequantization, bit for bit."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from metalserve.loader import ModelLoadError, load_model
from metalserve.loader.gguf_dequant import read_tensors
from metalserve.loader.gguf_header import AFFINE_TYPES
from metalserve.loader.gguf_loader import load_gguf
from metalserve.loader.gguf_reader import read_gguf
from tests.loader.gguf_arch_models import reference_model, write_arch_gguf
from tests.loader.gguf_blocks import K_QUANTS, T, add_encoded, encode
from tests.loader.tiny_models import logits

NEW_TYPES = [*K_QUANTS, T.Q5_0, T.Q5_1, T.BF16]
ALL_TYPES = [*NEW_TYPES, T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.F32]
SHAPES = {"a.weight": (6, 512), "b.weight": (3, 4, 256)}  # a matrix and stacked experts


def _write(path: Path, kind: T) -> None:
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, shape in SHAPES.items():
        data, _ = encode(rng.standard_normal(shape).astype(np.float32) * 0.1, kind, rng)
        add_encoded(writer, name, data, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_own(path: Path) -> dict[str, np.ndarray]:
    """gguf's own reader and dequantizer, independent of metalserve's header parser."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    return out


def _dense(tensors: dict[str, mx.array]) -> dict[str, np.ndarray]:
    """Plain values by tensor name; Q4_K/Q5_K/Q5_0/Q5_1 matrices come packed (MLX affine) and are unpacked by
    MLX's own dequantize."""
    out = {}
    for name, t in tensors.items():
        base = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")):
            continue
        if f"{base}.scales" in tensors:
            scales = tensors[f"{base}.scales"]
            bits = t.shape[-1] * 32 // (scales.shape[-1] * 32)  # 32 values a group
            t = mx.dequantize(t, scales, tensors[f"{base}.biases"], group_size=32, bits=bits)
        out[name] = np.array(t.astype(mx.float32))
    return out


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda k: k.name)
def test_tensors_equal_the_gguf_packages_dequantization(tmp_path: Path, kind: T) -> None:
    path = tmp_path / f"{kind.name}.gguf"
    _write(path, kind)
    got = _dense(read_tensors(read_gguf(path), mx.float32))
    want = _gguf_own(path)
    assert set(got) == set(want) == set(SHAPES)
    for name, w in want.items():
        g = got[name]
        assert g.shape == SHAPES[name] and np.isfinite(w).all()
        assert np.array_equal(g, w), f"{kind.name} {name}: max diff {np.abs(g - w).max()}"


@pytest.mark.parametrize("kind", NEW_TYPES, ids=lambda k: k.name)
def test_a_model_in_each_new_type_loads_its_exact_weights(tmp_path: Path, kind: T) -> None:
    path = tmp_path / f"llama-{kind.name}.gguf"
    reference = write_arch_gguf(path, "llama", kind)
    loaded = load_model(str(path), weights="dequantize")
    if kind.name in AFFINE_TYPES:  # read packed (MLX affine), then dequantized by the CPU rule
        desc = f"dequantized from {kind.name}"
    else:
        desc = "cast from BF16" if kind == T.BF16 else f"cast from {kind.name}, {kind.name} dequantized at read"
    assert loaded.weights_desc.startswith(f"fp32 ({desc}")
    params = dict(tree_flatten(loaded.model.parameters()))
    assert set(params) == set(reference)
    for name, want in reference.items():
        assert np.array_equal(np.array(params[name]), np.array(want)), name


def test_quantized_tensors_become_fp16_where_asked_and_bf16_stays_bf16(tmp_path: Path) -> None:
    _write(tmp_path / "q6k.gguf", T.Q6_K)
    half = read_tensors(read_gguf(tmp_path / "q6k.gguf"), mx.float16)
    assert half["a.weight"].dtype == mx.float16
    want = _gguf_own(tmp_path / "q6k.gguf")["a.weight"].astype(np.float16)
    assert np.array_equal(np.array(half["a.weight"]), want)
    _write(tmp_path / "bf16.gguf", T.BF16)
    assert read_tensors(read_gguf(tmp_path / "bf16.gguf"), mx.float16)["a.weight"].dtype == mx.bfloat16
    _write(tmp_path / "q4k.gguf", T.Q4_K)
    packed = read_tensors(read_gguf(tmp_path / "q4k.gguf"), mx.float16)
    assert packed["a.weight"].dtype == mx.uint32 and packed["a.scales"].dtype == mx.float16


@pytest.mark.parametrize(("kind", "bits"), [(T.Q4_K, 4), (T.Q5_K, 5), (T.Q5_0, 5)], ids=["Q4_K", "Q5_K", "Q5_0"])
def test_affine_types_stay_packed_in_mlx_layout_with_their_codes(tmp_path: Path, kind: T, bits: int) -> None:
    path = tmp_path / f"{kind.name}.gguf"
    reference = reference_model("qwen3", write_arch_gguf(path, "qwen3", kind))
    kept = load_model(str(path), weights="quantized")
    q = kept.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (bits, 32)
    assert kept.weights_desc.startswith(f"quantized {kind.name}")
    tokens = [1, 40, 41, 260, 261, 7, 99, 2]
    want = logits(reference, tokens)
    np.testing.assert_allclose(logits(kept.model, tokens), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # The CPU default keeps a fast-path family in its codes alone, as for Q4_0/Q4_1 (test_gguf_codes.py).
    auto = load_model(str(path))
    assert "model.layers.0.self_attn.q_proj" in auto.codes and "kept in its codes" in auto.weights_desc


def test_keeping_k_quants_quantized_is_refused_not_silently_dequantized(tmp_path: Path) -> None:
    path = tmp_path / "q6k.gguf"
    write_arch_gguf(path, "llama", T.Q6_K)
    with pytest.raises(ModelLoadError, match="Q6_K tensors, which cannot stay quantized.*weights 'auto'"):
        load_model(str(path), weights="quantized")
    bf16 = tmp_path / "bf16.gguf"
    write_arch_gguf(bf16, "llama", T.BF16)
    assert load_gguf(bf16, allow_dense=False).stored_as == "BF16"


def test_a_truncated_dequantized_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "q6k.gguf"
    write_arch_gguf(path, "llama", T.Q6_K)
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        load_model(str(tmp_path / "cut.gguf"))
