"""Tiny LoRA adapters made with mlx-lm's own LoRA classes, saved as `mlx_lm.lora` and PEFT save them,
and the reference: the base model with the adapter fused into its weights (mlx-lm's fuse)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters

from metalserve.loader import LoadedModel
from tests.models.archs import build

ATTENTION_KEYS = ["self_attn.q_proj", "self_attn.v_proj"]
ALL_KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"]


def lora_params(rank: int = 4, scale: float = 2.0, keys: list[str] | None = None) -> dict[str, object]:
    return {"rank": rank, "scale": scale, "dropout": 0.05, "keys": keys or ATTENTION_KEYS}


def make_mlx_lm_adapter(
    folder: Path,
    model_type: str = "llama",
    seed: int = 1,
    rank: int = 4,
    scale: float = 2.0,
    keys: list[str] | None = None,
    **shape: object,
) -> Path:
    """A trained-looking adapter: mlx-lm's LoRALinear layers, B drawn at random (training starts it at
    zero), saved with mlx-lm's names and config. `shape`: config overrides (an adapter of another model)."""
    model = build(model_type, **shape)
    params = lora_params(rank, scale, keys)
    num_layers = len(model.layers)
    linear_to_lora_layers(model, num_layers, params)
    mx.random.seed(seed)
    weights = {
        name: (mx.random.normal(w.shape) * 0.2 if name.endswith("lora_b") else w)
        for name, w in tree_flatten(model.parameters())
        if name.endswith(("lora_a", "lora_b"))
    }
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def as_peft(mlx_lm_folder: Path, folder: Path, alpha: float) -> Path:
    """The same adapter in PEFT's layout: torch Linear shapes, `base_model.model.` names, r and
    lora_alpha (scale = alpha / r): give `alpha = scale * rank` for the same adapter."""
    config = json.loads((mlx_lm_folder / "adapter_config.json").read_text())
    rank = config["lora_parameters"]["rank"]
    weights = mx.load(str(mlx_lm_folder / "adapters.safetensors"))
    peft = {}
    for name, w in weights.items():  # type: ignore[union-attr]
        path, leaf = name.rsplit(".", 1)
        peft_leaf = "lora_A.weight" if leaf == "lora_a" else "lora_B.weight"
        peft[f"base_model.model.{path}.{peft_leaf}"] = w.T
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), peft)
    modules = sorted({k.rsplit(".", 1)[-1] for k in config["lora_parameters"]["keys"]})
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.1, "target_modules": modules}
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))
    return folder


def fused_model(folder: Path, model_type: str = "llama") -> nn.Module:
    """mlx-lm's own route: load the adapter onto the base model, then fuse it into the weights."""
    model = build(model_type)
    load_adapters(model, str(folder))
    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    model.update_modules(tree_unflatten(fused))
    mx.eval(model.parameters())
    return model


def loaded_of(model_type: str) -> LoadedModel:
    """The tiny base model as the loader hands it over (no tokenizer: the tests feed token ids)."""
    return LoadedModel(
        model=build(model_type),
        tokenizer=None,
        model_type=model_type,
        config={},
        max_model_len=256,  # type: ignore[arg-type]
        eos_token_ids=frozenset(),
        chat_template=None,
        source="tiny",
        weights_desc="fp32",
        blas_desc="-",
    )
