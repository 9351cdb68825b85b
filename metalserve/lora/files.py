"""Reading an adapter directory: mlx-lm's (`mlx_lm.lora` writes `adapters.safetensors` +
`adapter_config.json`) or PEFT's (`adapter_model.safetensors` + `adapter_config.json`).

Both become one `AdapterWeights`: per target module (mlx-lm's module path, e.g.
`model.layers.0.self_attn.q_proj`), A `[in, r]` and B `[r, out]` with the scale folded into B, so a
token's delta is `(x @ A) @ B`. Dropout is a training-time setting: it is read past, not applied.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter that cannot be served over this model; the message says why and names the adapter."""


@dataclass(frozen=True)
class AdapterWeights:
    name: str
    rank: int
    modules: dict[str, tuple[mx.array, mx.array]]  # module path -> (A [in, r], B [r, out] * scale)
    key: str  # name + content hash (lora/request.py)
    path: str = ""  # the directory it was read from

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter(name: str, path: str | Path, max_rank: int) -> AdapterWeights:
    """The adapter at `path`, in either format; AdapterError for a missing file, an unknown format, a
    rank above `max_rank` or weights whose shapes disagree with the config."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter {name!r}: {folder} is not a directory")
    config = _read_config(name, folder)
    if (folder / MLX_LM_WEIGHTS).is_file():
        weights_file = folder / MLX_LM_WEIGHTS
        rank, modules = _mlx_lm_modules(name, config, _load(name, weights_file))
    elif (folder / PEFT_WEIGHTS).is_file():
        weights_file = folder / PEFT_WEIGHTS
        rank, modules = _peft_modules(name, config, _load(name, weights_file))
    else:
        raise AdapterError(f"LoRA adapter {name!r}: {folder} holds neither {MLX_LM_WEIGHTS} nor {PEFT_WEIGHTS}")
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    if not modules:
        raise AdapterError(f"LoRA adapter {name!r}: no LoRA weights in {weights_file.name}")
    digest = hashlib.sha256(weights_file.read_bytes()).hexdigest()[:32]
    return AdapterWeights(name, rank, modules, f"{name}@{digest}", str(folder))


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter {name!r}: no {CONFIG} in {folder}") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"LoRA adapter {name!r}: {CONFIG} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {CONFIG} must hold a JSON object")
    return config


def _load(name: str, file: Path) -> dict[str, mx.array]:
    try:
        return {k: v.astype(mx.float32) for k, v in mx.load(str(file)).items()}  # type: ignore[union-attr]
    except (RuntimeError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {file.name} ({exc})") from None


def _mlx_lm_modules(
    name: str, config: dict[str, Any], weights: dict[str, mx.array]
) -> tuple[int, dict[str, tuple[mx.array, mx.array]]]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"LoRA adapter {name!r}: fine_tune_type {kind!r} is not served (only lora)")
    params = config.get("lora_parameters") or {}
    if "rank" not in params or "scale" not in params:
        raise AdapterError(f"LoRA adapter {name!r}: {CONFIG} lacks lora_parameters.rank or .scale")
    rank, scale = int(params["rank"]), float(params["scale"])
    pairs = _pairs(name, weights, ".lora_a", ".lora_b")
    modules = {path: _checked(name, path, a, b, rank, scale) for path, (a, b) in pairs.items()}
    return rank, modules


def _peft_modules(
    name: str, config: dict[str, Any], weights: dict[str, mx.array]
) -> tuple[int, dict[str, tuple[mx.array, mx.array]]]:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not served")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"LoRA adapter {name!r}: per-module rank_pattern/alpha_pattern is not supported")
    if config.get("use_dora"):
        raise AdapterError(f"LoRA adapter {name!r}: DoRA adapters are not served")
    rank = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    stripped = {k.removeprefix(_PEFT_PREFIX): v for k, v in weights.items()}
    pairs = _pairs(name, stripped, ".lora_A.weight", ".lora_B.weight")
    if any(a.ndim != 2 for a, _ in pairs.values()):
        raise AdapterError(f"LoRA adapter {name!r}: PEFT adapters on MoE experts are not served (mlx-lm's are)")
    # PEFT stores torch's Linear layout: A [r, in], B [out, r].
    return rank, {path: _checked(name, path, a.T, b.T, rank, scale) for path, (a, b) in pairs.items()}


def _pairs(
    name: str, weights: dict[str, mx.array], a_suffix: str, b_suffix: str
) -> dict[str, tuple[mx.array, mx.array]]:
    pairs: dict[str, tuple[mx.array, mx.array]] = {}
    for key in sorted(weights):  # the first problem in layer order
        if key.endswith(a_suffix):
            path = key[: -len(a_suffix)]
            if path + b_suffix not in weights:
                raise AdapterError(f"LoRA adapter {name!r}: {key} has no matching {path + b_suffix}")
            pairs[path] = (weights[key], weights[path + b_suffix])
        elif not key.endswith(b_suffix):
            raise AdapterError(f"LoRA adapter {name!r}: {key} is not a LoRA weight (only LoRA A/B are served)")
    return pairs


def _checked(name: str, path: str, a: mx.array, b: mx.array, rank: int, scale: float) -> tuple[mx.array, mx.array]:
    if a.ndim == 3 and b.ndim == 3 and a.shape[1] == rank and b.shape[2] == rank:
        # mlx-lm's LoRASwitchLinear, one A and B per expert: A [E, r, in], B [E, out, r] -> [E, in, r], [E, r, out].
        return a.swapaxes(1, 2), b.swapaxes(1, 2) * scale
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != rank or b.shape[0] != rank:
        raise AdapterError(
            f"LoRA adapter {name!r}: {path} has A {tuple(a.shape)} and B {tuple(b.shape)}, not rank {rank}"
        )
    return a, b * scale
