"""A model's fingerprint for the KV store: what decides the K/V pages a token prefix produces.

Hashing every weight would cost seconds at start-up; a strided sample of each parameter (its name,
shape, dtype and up to 256 values) tells different checkpoints, quantizations and random inits apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

SAMPLE_VALUES = 256


def _sample(a: mx.array) -> bytes:
    flat = a.reshape(-1)
    step = max(1, flat.size // SAMPLE_VALUES)
    picked = flat[::step][:SAMPLE_VALUES]
    if picked.dtype == mx.bfloat16:
        picked = picked.view(mx.uint16)
    return np.array(picked).tobytes()


def model_fingerprint(model: Any, model_type: str, extra: dict[str, Any] | None = None) -> str:
    """32 hex digits over the model type, `extra` (the KV layout, dtype...) and every parameter's sample."""
    h = hashlib.sha256()
    h.update(json.dumps({"model_type": model_type, **(extra or {})}, sort_keys=True, default=str).encode())
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        if isinstance(value, mx.array):
            h.update(f"{name}|{value.shape}|{value.dtype}".encode())
            h.update(_sample(value))
    return h.hexdigest()[:32]
