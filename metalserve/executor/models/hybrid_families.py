"""Where each hybrid family keeps its parts in mlx-lm: the backbone, the head, and per layer its token
mixer (attention or a recurrent-state layer). Plain getattr only: the loader reads the KV shape here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

MixerKind = Literal["attention", "state"]


@dataclass(frozen=True)
class Mixer:
    """One layer's token mixer: `owner.<attr>` is the mlx-lm module."""

    layer_idx: int
    kind: MixerKind
    owner: Any
    attr: str

    @property
    def module(self) -> Any:
        return getattr(self.owner, self.attr)


@dataclass(frozen=True)
class Family:
    language_model: Callable[[Any], Any]  # the object holding the backbone and lm_head
    backbone_attr: str
    embed_attr: str
    mixer_of: Callable[[Any], tuple[MixerKind, str] | None]  # a layer -> its mixer, or None (MLP-only)


def _qwen_next_mixer(layer: Any) -> tuple[MixerKind, str]:
    return ("state", "linear_attn") if layer.is_linear else ("attention", "self_attn")


def _lfm2_mixer(layer: Any) -> tuple[MixerKind, str]:
    return ("attention", "self_attn") if layer.is_attention_layer else ("state", "conv")


def _granite_mixer(layer: Any) -> tuple[MixerKind, str]:
    return ("state", "mamba") if layer.layer_type == "mamba" else ("attention", "self_attn")


def _nemotron_mixer(layer: Any) -> tuple[MixerKind, str] | None:
    return {"M": ("state", "mixer"), "*": ("attention", "mixer")}.get(layer.block_type)  # type: ignore[return-value]


FAMILIES: dict[str, Family] = {
    "qwen3_next": Family(lambda m: m, "model", "embed_tokens", _qwen_next_mixer),
    "qwen3_5": Family(lambda m: m.language_model, "model", "embed_tokens", _qwen_next_mixer),
    "qwen3_5_moe": Family(lambda m: m.language_model, "model", "embed_tokens", _qwen_next_mixer),
    "lfm2": Family(lambda m: m, "model", "embed_tokens", _lfm2_mixer),
    "lfm2_moe": Family(lambda m: m, "model", "embed_tokens", _lfm2_mixer),
    "nemotron_h": Family(lambda m: m, "backbone", "embeddings", _nemotron_mixer),
    "granitemoehybrid": Family(lambda m: m, "model", "embed_tokens", _granite_mixer),
}


def backbone_of(model: Any, model_type: str) -> Any:
    family = FAMILIES[model_type]
    return getattr(family.language_model(model), family.backbone_attr)


def embedding_of(model: Any, model_type: str) -> Any:
    return getattr(backbone_of(model, model_type), FAMILIES[model_type].embed_attr)


def logits_divisor(model: Any, model_type: str) -> float:
    """What mlx-lm divides the logits by after the head (Granite's `logits_scaling`), 1 for most."""
    return float(getattr(FAMILIES[model_type].language_model(model), "logits_scaling", 1.0))


def mixers_of(model: Any, model_type: str) -> list[Mixer]:
    """Every layer's token mixer, in layer order (MLP-only layers have none)."""
    of = FAMILIES[model_type].mixer_of
    out = []
    for i, layer in enumerate(backbone_of(model, model_type).layers):
        found = of(layer)
        if found is not None:
            out.append(Mixer(i, found[0], layer, found[1]))
    return out


def _attr(module: Any, *names: str) -> Any:
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"{type(module).__name__} has none of {names}")


def attention_shape(model: Any, model_type: str) -> tuple[int, int, int]:
    """(attention layers, KV heads, head dim): the paged KV cache holds attention layers only."""
    attns = [m.module for m in mixers_of(model, model_type) if m.kind == "attention"]
    if not attns:
        raise ValueError(f"a {model_type} model without attention layers is not supported")
    first = getattr(attns[0], "inner", attns[0])  # ours keeps mlx-lm's module as `inner`
    kv_heads = int(_attr(first, "n_kv_heads", "num_key_value_heads"))
    return len(attns), kv_heads, int(first.k_proj.weight.shape[0]) // kv_heads
