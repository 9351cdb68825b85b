"""A BERT encoder on the host (NumPy's BLAS for the matmuls, numba for GELU and layer norm), over the
packed token axis: every prompt of a step on one `[T, hidden]` array, no padding.

Why not MLX here: its CPU backend computes GELU's erf and softmax's exp one element at a time (GELU on a
2048 x 1536 tile 75-120 ms, the attention softmax as slow), and its matmul ran at a third of NumPy's
BLAS; mlx-embeddings' padded batches ran all-MiniLM-L6-v2 2-7x slower than sentence-transformers. Token-
wise layers run on the packed rows; attention (numba) runs per prompt, bidirectional within it, so no
prompt pays for another's length.

Also serves BERT cross-encoders (BertForSequenceClassification): the pooler (tanh of a dense layer over
the first token) and the classifier head, with the pair's token types (segment 1 after the first [SEP]).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metalserve.kernels.cpu.encoder_ops import add_layer_norm_in_place, bidirectional_attention, gelu_in_place


@dataclass(frozen=True)
class _Layer:
    qkv: np.ndarray  # [hidden, 3 * hidden]: x @ qkv gives q, k, v side by side
    qkv_bias: np.ndarray
    out: np.ndarray  # [hidden, hidden]
    out_bias: np.ndarray
    norm1: tuple[np.ndarray, np.ndarray]
    up: np.ndarray  # [hidden, intermediate]
    up_bias: np.ndarray
    down: np.ndarray  # [intermediate, hidden]
    down_bias: np.ndarray
    norm2: tuple[np.ndarray, np.ndarray]


class HostBert:
    """BertModel's forward (and BertForSequenceClassification's head when the weights hold one)."""

    def __init__(self, config: dict[str, Any], weights: dict[str, np.ndarray]) -> None:
        act = config.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"the host BERT computes the exact (erf) GELU, not {act!r}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("the host BERT has absolute position embeddings only")
        prefix = "bert." if any(k.startswith("bert.") for k in weights) else ""

        def w(name: str) -> np.ndarray:
            return np.ascontiguousarray(weights[prefix + name], dtype=np.float32)

        def t(name: str) -> np.ndarray:  # a Linear's [out, in] weight as the [in, out] that x @ W takes
            return np.ascontiguousarray(w(name).T)

        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.words = w("embeddings.word_embeddings.weight")
        self.positions = w("embeddings.position_embeddings.weight")
        self.types = w("embeddings.token_type_embeddings.weight")
        self.norm = (w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"))
        self.layers: list[_Layer] = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            names = ("query", "key", "value")
            self.layers.append(
                _Layer(
                    qkv=np.ascontiguousarray(np.concatenate([t(f"{p}attention.self.{n}.weight") for n in names], 1)),
                    qkv_bias=np.concatenate([w(f"{p}attention.self.{n}.bias") for n in names]),
                    out=t(f"{p}attention.output.dense.weight"),
                    out_bias=w(f"{p}attention.output.dense.bias"),
                    norm1=(w(f"{p}attention.output.LayerNorm.weight"), w(f"{p}attention.output.LayerNorm.bias")),
                    up=t(f"{p}intermediate.dense.weight"),
                    up_bias=w(f"{p}intermediate.dense.bias"),
                    down=t(f"{p}output.dense.weight"),
                    down_bias=w(f"{p}output.dense.bias"),
                    norm2=(w(f"{p}output.LayerNorm.weight"), w(f"{p}output.LayerNorm.bias")),
                )
            )
        self.classifier: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        if "classifier.weight" in weights:
            self.classifier = (
                t("pooler.dense.weight"),
                w("pooler.dense.bias"),
                np.ascontiguousarray(np.asarray(weights["classifier.weight"], np.float32).T),
                np.asarray(weights["classifier.bias"], np.float32),
            )

    @property
    def nbytes(self) -> int:
        arrays = [self.words, self.positions, self.types, *self.norm, *(self.classifier or ())]
        arrays += [a for layer in self.layers for a in _arrays(layer)]
        return sum(int(a.nbytes) for a in arrays)

    @property
    def num_labels(self) -> int:
        return 0 if self.classifier is None else int(self.classifier[3].shape[0])

    def forward(self, ids: np.ndarray, token_types: np.ndarray, cu_seqlens: np.ndarray) -> np.ndarray:
        """The last hidden states `[T, hidden]` of the packed prompts `ids[cu[i]:cu[i+1]]`."""
        positions = np.concatenate(
            [np.arange(int(b - a)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
        )
        if positions.size and int(positions.max()) >= self.positions.shape[0]:
            raise ValueError(f"a prompt is longer than the model's {self.positions.shape[0]} positions")
        x = self.words[ids] + self.positions[positions] + self.types[token_types]
        add_layer_norm_in_place(x, None, *self.norm, self.eps)
        for layer in self.layers:
            x = self._layer(layer, x, cu_seqlens)
        return x

    def classify(self, first_rows: np.ndarray) -> np.ndarray:
        """The classifier's logits `[n, labels]` of the prompts' first-token states (BertPooler, then the
        linear head)."""
        if self.classifier is None:
            raise ValueError("this BERT has no classification head")
        pool_w, pool_b, head_w, head_b = self.classifier
        pooled = np.tanh(first_rows @ pool_w + pool_b)
        return pooled @ head_w + head_b

    def _layer(self, layer: _Layer, x: np.ndarray, cu: np.ndarray) -> np.ndarray:
        qkv = x @ layer.qkv
        qkv += layer.qkv_bias
        context = bidirectional_attention(qkv, cu, self.heads)
        out = context @ layer.out
        out += layer.out_bias
        add_layer_norm_in_place(out, x, *layer.norm1, self.eps)
        up = out @ layer.up
        up += layer.up_bias
        gelu_in_place(up)
        down = up @ layer.down
        down += layer.down_bias
        add_layer_norm_in_place(down, out, *layer.norm2, self.eps)
        return down


def _arrays(layer: _Layer) -> list[np.ndarray]:
    head = [layer.qkv, layer.qkv_bias, layer.out, layer.out_bias, *layer.norm1, layer.up, layer.up_bias]
    return head + [layer.down, layer.down_bias, *layer.norm2]


def load_host_bert(path: Path) -> HostBert:
    """The BERT of a Hugging Face directory (config.json and *.safetensors; float32, float16 or bfloat16
    weights, read through MLX, which knows bfloat16, and widened to float32)."""
    import mlx.core as mx

    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no .safetensors weights (the host BERT reads safetensors only)")
    weights: dict[str, np.ndarray] = {}
    for file in files:
        loaded = mx.load(str(file))
        assert isinstance(loaded, dict)
        for name, array in loaded.items():
            if mx.issubdtype(array.dtype, mx.floating):  # not the int64 position_ids buffer
                weights[name] = np.asarray(array.astype(mx.float32))
    return HostBert(config, weights)
