"""GGUF matrices kept in their packed codes on the CPU fast path: the same values as gguf's dequantizer, no
fp32 copy, and the same tokens and log-probabilities as the dequantized fp32 model."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.executor.host.compute import HostCompute
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader import gguf_codes, load_model
from metalserve.loader import load as load_module
from metalserve.loader.codes_linear import CodesEmbedding, CodesLinear
from metalserve.loader.gguf_codes import CODES_TYPES, FileRows, packed_codes
from metalserve.loader.gguf_reader import GGUFFile, TensorInfo, release_pages
from metalserve.platform import current_platform
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import NewRequestData, SchedulerOutput
from tests.executor.simple_driver import run_to_completion
from tests.executor.test_runner_golden import make_runner, mlx_lm_greedy, prompts_of
from tests.loader.gguf_arch_models import reference_model, write_arch_gguf
from tests.loader.gguf_blocks import T, encode
from tests.loader.tiny_models import logits

pytestmark = pytest.mark.skipif(not current_platform().host_compute, reason="the codes path is MLX's CPU backend's")
TOKENS = [1, 40, 41, 260, 261, 7, 99, 2, 150, 33]


@pytest.mark.parametrize("kind", [T[name] for name in CODES_TYPES], ids=lambda k: k.name)
def test_codes_decode_to_the_gguf_packages_values(kind: T) -> None:
    rng = np.random.default_rng(3)
    data, want = encode(rng.standard_normal((6, 512)).astype(np.float32) * 0.1, kind, rng)
    got = packed_codes(np.ascontiguousarray(data).view(np.uint8).reshape(-1), kind.name, (6, 512))
    assert got.bits == {"Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}.get(kind.name, 4)
    assert got.group_size == (16 if kind == T.Q6_K else 32)
    # scale * q + offset against gguf's d * (q - zero): equal up to the scale's and offset's rounding to
    # float16 (2^-11 of each; K-quant scales are a float16 times an integer).
    assert got.scales.dtype == np.float16
    np.testing.assert_allclose(got.dense(), want, rtol=2.0**-11, atol=2.0**-10 * np.abs(want).max())


@pytest.mark.parametrize("kind", [T.Q5_0, T.Q6_K])
def test_a_tensor_of_many_chunks_packs_as_one_chunk_would(kind: T, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows converted a chunk at a time into arrays allocated once (no join at the end): the same codes,
    scales and offsets as one chunk, the last chunk shorter than the others included."""
    rng = np.random.default_rng(5)
    data, want = encode(rng.standard_normal((11, 512)).astype(np.float32) * 0.1, kind, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    whole = packed_codes(raw, kind.name, (11, 512))
    monkeypatch.setattr(gguf_codes, "_CHUNK_VALUES", 4 * 512)  # chunks of 4 rows: 4, 4 and 3
    chunked = packed_codes(raw, kind.name, (11, 512))
    for field in ("codes", "scales", "biases"):
        np.testing.assert_array_equal(getattr(chunked, field), getattr(whole, field))
    np.testing.assert_allclose(chunked.dense(), want, rtol=2.0**-11, atol=2.0**-10 * np.abs(want).max())


def _mapped_rss_kb(path: Path) -> int:
    """This process's resident kB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_converting_a_tensor_releases_the_file_pages_it_read(tmp_path: Path) -> None:
    """After a tensor is converted, the GGUF's pages it read leave this process's resident memory (before,
    the whole file counted at the load's peak beside the converted copy); the bytes still read back."""
    path = tmp_path / "blob.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 4 << 20).astype(np.uint8).tobytes())
    data = np.memmap(path, dtype=np.uint8, mode="r")
    info = TensorInfo("blk.0.ffn_up.weight", (1024, 4096), "Q8_0", 4096, (3 << 20) + 5)
    file = GGUFFile({}, {info.name: info}, data)
    checksum = int(data[info.start : info.start + info.nbytes].sum(dtype=np.int64))  # reads every page
    before = _mapped_rss_kb(path)
    release_pages(file, info)
    after = _mapped_rss_kb(path)
    assert before >= 3 << 10 and before - after >= (3 << 10) - 8, (before, after)
    assert int(data[info.start : info.start + info.nbytes].sum(dtype=np.int64)) == checksum


def test_the_load_hands_freed_heap_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The freed heap goes back to the system once a model is loaded (platform.return_freed_memory:
    glibc's malloc_trim), after the conversion's temporaries are gone."""
    calls: list[int] = []
    monkeypatch.setattr(load_module, "return_freed_memory", lambda: calls.append(1))
    path = tmp_path / "qwen2.gguf"
    write_arch_gguf(path, "qwen2", T.Q4_0)
    load_model(str(path))
    assert calls == [1]


def test_zero_rows_in_give_zero_rows_out() -> None:
    """A step that samples no row (a prefill chunk mid-prompt, on the MLX route: pipeline ranks, quantized KV
    pages, LoRA) asks the tied head for zero rows; before, reshaping the empty output raised."""
    rng = np.random.default_rng(4)
    data, _ = encode(rng.standard_normal((6, 512)).astype(np.float32) * 0.1, T.Q4_0, rng)
    codes = packed_codes(np.ascontiguousarray(data).view(np.uint8).reshape(-1), "Q4_0", (6, 512))
    assert CodesLinear([codes])(mx.zeros((0, 512))).shape == (0, 6)
    assert CodesEmbedding(codes).as_linear(mx.zeros((1, 0, 512))).shape == (1, 0, 6)
    assert CodesEmbedding(codes)(mx.array([[1, 5]])).shape == (1, 2, 512)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _as_kept(arch: str, weights: dict[str, mx.array], codes: dict[str, object]) -> nn.Module:
    """The reference with each packed matrix as the codes keep it: the file's codes, each group's scale and
    offset rounded to float16 (packed_codes.py). The codes kernels must reproduce this model to fp32
    rounding; the file's own values differ from it by that float16 rounding alone."""
    kept = dict(weights)
    for name, c in codes.items():
        if isinstance(c, PackedCodes):
            kept[name + ".weight"] = mx.array(c.dense())
    return reference_model(arch, kept)


# A Q4_K_M file's mix: 4-bit q/k/o/gate/up, 6-bit attn_v and ffn_down (groups of 16), an 8-bit embedding.
MIXED = {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K, "token_embd.weight": T.Q8_0}


@pytest.mark.parametrize(
    ("arch", "kind", "kinds"),
    [("llama", T.Q4_0, {}), ("qwen2", T.Q4_K, MIXED), ("qwen3", T.Q5_K, {"attn_k.weight": T.Q4_1})],
)
def test_the_codes_model_matches_the_dequantized_one(tmp_path: Path, arch: str, kind: T, kinds: dict) -> None:
    path = tmp_path / f"{arch}.gguf"
    weights = write_arch_gguf(path, arch, kind, kinds=kinds)
    loaded = load_model(str(path))  # the CPU default for a fast-path family: codes, no fp32 copy
    reference, exact = _as_kept(arch, weights, loaded.codes), reference_model(arch, weights)
    assert "kept in its codes" in loaded.weights_desc, loaded.weights_desc
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, CodesLinear) and isinstance(layer.mlp.down_proj, CodesLinear)
    assert isinstance(loaded.model.model.embed_tokens, CodesEmbedding)
    assert isinstance(loaded.codes["model.embed_tokens"], PackedCodes)  # tied: the head reads the same codes
    dense = [m for _, m in loaded.model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    assert dense == [] or all(m.weight.size < 1000 for m in dense)  # nothing of a matrix's size in fp32
    # The MLX modules (through the codes kernels) give the dequantized model's log-probabilities.
    got, want = _log_softmax(logits(loaded.model, TOKENS)), _log_softmax(logits(reference, TOKENS))
    assert np.abs(got - want).max() < 1e-3
    # The file's exact values: within the float16 rounding of scales (2^-11 of each), which these random
    # models' logits (tens) carry to a few hundredths at most.
    file_values = _log_softmax(logits(exact, TOKENS))
    assert np.abs(got - file_values).max() < 1e-3 * (1 + np.abs(file_values).max())
    # The paged runner with the host decoder: the reference's greedy tokens.
    prompts = prompts_of([5, 40, 17, 1, 33], reference.args.vocab_size, seed=4)
    expected = [mlx_lm_greedy(reference, p, 12) for p in prompts]
    runner = make_runner(loaded.model, arch, attention="cpu", codes=loaded.codes)
    paged = runner.model
    assert isinstance(paged.compute, HostCompute) and paged.compute.forward_on_host is not None
    assert paged.compute.forward_on_host.codes_only
    got_tokens = run_to_completion(runner, prompts, [SamplingParams(temperature=0, max_tokens=12) for _ in prompts])
    assert got_tokens == expected
    # Held once: the codes the loader read are what the host path holds.
    assert paged.host_bytes() == sum(c.nbytes for c in loaded.codes.values())


def test_an_untied_embedding_stays_in_its_file(tmp_path: Path) -> None:
    """A table the head does not share is left in the GGUF's mapped bytes (nothing held beyond the file's
    pages): its lookups convert the rows asked for, and the model gives the reference's greedy tokens."""
    path = tmp_path / "phi3.gguf"
    weights = write_arch_gguf(path, "phi3", T.Q5_0)
    reference = reference_model("phi3", weights)
    loaded = load_model(str(path))
    table = loaded.codes["model.embed_tokens"]
    assert isinstance(table, FileRows) and table.nbytes == 0
    assert isinstance(loaded.codes["lm_head"], PackedCodes)
    want = np.array(weights["model.embed_tokens.weight"])
    ids = np.array([0, 7, 3, 7, want.shape[0] - 1])
    embed = loaded.model.model.embed_tokens
    np.testing.assert_allclose(embed.lookup(ids), want[ids], rtol=1e-6, atol=1e-6)
    assert embed.lookup(np.zeros(0, np.int64)).shape == (0, want.shape[1])
    with pytest.raises(ValueError, match="row ids"):
        table.rows(np.array([want.shape[0]]))
    with pytest.raises(TypeError, match="read from its file"):
        embed.as_linear(mx.zeros((1, want.shape[1])))
    prompts = prompts_of([5, 40], reference.args.vocab_size, seed=8)
    runner = make_runner(loaded.model, "phi3", attention="cpu", codes=loaded.codes)
    assert runner.model.compute.forward_on_host is not None
    got = run_to_completion(runner, prompts, [SamplingParams(temperature=0, max_tokens=8) for _ in prompts])
    assert got == [mlx_lm_greedy(reference, p, 8) for p in prompts]


def test_steps_the_host_decoder_does_not_take_read_the_codes_through_the_modules(tmp_path: Path) -> None:
    path = tmp_path / "qwen2.gguf"
    weights = write_arch_gguf(path, "qwen2", T.Q4_K, kinds=MIXED)
    loaded = load_model(str(path))
    reference = _as_kept("qwen2", weights, loaded.codes)
    runner = make_runner(loaded.model, "qwen2", attention="cpu", codes=loaded.codes)
    runner.model.compute.forward_on_host = None  # as on quantized KV pages: every step through the modules
    prompts = prompts_of([9, 30], reference.args.vocab_size, seed=5)
    got = run_to_completion(runner, prompts, [SamplingParams(temperature=0, max_tokens=8) for _ in prompts])
    assert got == [mlx_lm_greedy(reference, p, 8) for p in prompts]


def test_dequantize_and_other_families_keep_the_fp32_route(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write_arch_gguf(path, "llama", T.Q4_K)
    fp32 = load_model(str(path), weights="dequantize")
    assert fp32.weights_desc.startswith("fp32") and type(fp32.model.model.layers[0].self_attn.q_proj) is nn.Linear
    moe = tmp_path / "qwen3moe.gguf"
    write_arch_gguf(moe, "qwen3moe", T.Q4_0)
    other = load_model(str(moe))  # not a fast-path family: its modules run in MLX, on fp32
    assert other.weights_desc.startswith("fp32") and not any(
        isinstance(m, CodesLinear) for _, m in other.model.named_modules()
    )
    mx.clear_cache()


def test_long_prefill_chunks_match_the_dequantized_model(tmp_path: Path) -> None:
    """Chunks of 64 rows and more take the prefill kernels (dequantized tiles through MKL's GEMM, blocked
    causal attention): prompt log-probabilities within 1e-3 of the dequantized model's (as the codes keep
    it), the same greedy tokens, a step that mixes a long chunk with another request's rows included."""
    path = tmp_path / "qwen2.gguf"
    weights = write_arch_gguf(path, "qwen2", T.Q4_K, kinds=MIXED)
    loaded = load_model(str(path))
    reference = _as_kept("qwen2", weights, loaded.codes)
    runner = make_runner(loaded.model, "qwen2", attention="cpu", codes=loaded.codes)
    assert runner.model.compute.forward_on_host is not None
    (prompt,) = prompts_of([150], reference.args.vocab_size, seed=6)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    new = NewRequestData("p", prompt, len(prompt), params, (list(range(10)),), 0)
    out = runner.execute_model(SchedulerOutput([new], [], {"p": len(prompt)}, len(prompt)))
    first, got = out.prompt_logprobs["p"]
    want = _log_softmax(logits(reference, prompt))
    for i, lp in enumerate(got):
        pos = first + i  # the logprob of prompt[pos], predicted at pos - 1
        assert abs(lp.logprob - want[pos - 1, prompt[pos]]) < 1e-3
    assert len(got) == len(prompt) - 1
    runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids={"p"}))
    prompts = prompts_of([150, 90, 6], reference.args.vocab_size, seed=7)
    greedy = [SamplingParams(temperature=0, max_tokens=10) for _ in prompts]
    got_tokens = run_to_completion(runner, prompts, greedy, chunk_size=100)
    assert got_tokens == [mlx_lm_greedy(reference, p, 10) for p in prompts]
