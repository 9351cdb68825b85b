"""A model's fingerprint for the KV store: what decides the K/V pages a token prefix produces.

Hashing every weight would cost seconds at start-up; a strided sample of each parameter (its name,
shape, dtype and up to 256 values) tells different checkpoints, quantizations and random inits apart.
The weights alone do not decide the pages: RoPE's base and scaling, norm epsilons, windows and soft-caps
live in the config (and `--hf-overrides` edits them), so the config is hashed too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

SAMPLE_VALUES = 256
# Config keys that never change a K/V page (token ids, names, provenance): leaving them out keeps a store
# warm across edits that cannot matter. Every other key counts, so an unknown one errs towards a miss.
NOT_KV_SHAPING = frozenset(
    {
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "architectures",
        "transformers_version",
        "_name_or_path",
        "auto_map",
        "tokenizer_class",
        "use_cache",
    }
)


def kv_shaping_config(config: dict[str, Any], model: Any = None) -> dict[str, Any]:
    """The config that shapes K/V: the HF-style `config` (overrides applied) without the keys that cannot
    matter, and the arguments the model was built from (`model.args`, mlx-lm's ModelArgs), which is what
    a layer actually reads."""
    shaping: dict[str, Any] = {k: v for k, v in config.items() if k not in NOT_KV_SHAPING}
    args = getattr(model, "args", None)
    if args is not None and hasattr(args, "__dict__"):
        shaping["model_args"] = {k: v for k, v in vars(args).items() if k not in NOT_KV_SHAPING}
    return shaping


def _sample(a: mx.array) -> bytes:
    flat = a.reshape(-1)
    step = max(1, flat.size // SAMPLE_VALUES)
    picked = flat[::step][:SAMPLE_VALUES]
    if picked.dtype == mx.bfloat16:
        picked = picked.view(mx.uint16)
    return np.array(picked).tobytes()


def _stable(value: Any) -> Any:
    """JSON for what json cannot write, the same in every process (no object addresses)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # one level: json recurses
        return {
            "__type__": type(value).__qualname__,
            **{f.name: getattr(value, f.name) for f in dataclasses.fields(value)},
        }
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    text = str(value)
    return type(value).__qualname__ if " at 0x" in text else text


def model_fingerprint(model: Any, model_type: str, extra: dict[str, Any] | None = None) -> str:
    """32 hex digits over the model type, `extra` (the KV layout, dtype...) and every parameter's sample."""
    h = hashlib.sha256()
    h.update(json.dumps({"model_type": model_type, **(extra or {})}, sort_keys=True, default=_stable).encode())
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        if isinstance(value, mx.array):
            h.update(f"{name}|{value.shape}|{value.dtype}".encode())
            h.update(_sample(value))
    return h.hexdigest()[:32]
