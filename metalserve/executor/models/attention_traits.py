"""What one mlx-lm attention module does, read off the module itself: heads, scale, window, sinks, softcap.

mlx-lm's families spell the same facts differently (`n_heads` or `num_attention_heads`, `scale` or
`sm_scale`, a window from `layer_types`, `is_sliding` or `use_sliding`); this module is the one place
that knows the spellings, so the paged attention layer and the KV layout read them alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from metalserve.executor.models.rope import check_rope


@dataclass(frozen=True)
class AttentionTraits:
    """One layer's attention as the paged KV cache and the backends see it."""

    layer: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    window: int | None  # keys within the last `window` positions only (the token itself included)
    softcap: float | None  # scores become softcap * tanh(scores / softcap) (gemma2)
    has_sinks: bool  # per-head sink logits (gpt-oss's `sinks`)
    kv_source: int  # the layer whose K/V this one reads: itself, or an earlier layer (gemma4's shared KV)
    # Llama 4's query scaling by position (ministral3): q *= 1 + beta * log(1 + floor(pos / original)).
    position_scale: tuple[float, int] | None = None
    rotary: bool = True  # False: no RoPE on this layer (cohere2 and exaone4 rotate their sliding layers only)


def _first(module: nn.Module, *names: str) -> object:
    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return value
    raise ValueError(f"{type(module).__name__} has none of the attributes {names}: not a known attention module")


# Set on the backbone of a pipeline stage's slice (distributed/stage.py keep_layers): the whole model's
# index of its first kept layer. Per-model lists (`layer_types`, gemma4's `previous_kvs`) stay whole.
FIRST_LAYER_ATTR = "pipeline_first_layer"


def first_layer(model: nn.Module) -> int:
    """The whole model's index of `model.model.layers[0]` (0 unless the model is a pipeline slice)."""
    return int(getattr(model.model, FIRST_LAYER_ATTR, 0))


def _layer_types(model: nn.Module) -> list[str] | None:
    backbone, args = model.model, model.args
    types = getattr(backbone, "layer_types", None) or getattr(args, "layer_types", None)
    return list(types) if types else None


def _window(model: nn.Module, i: int, inner: nn.Module) -> int | None:
    """The window of layer i where mlx-lm's own forward masks it by one (and only there)."""
    layer = model.model.layers[i]
    types = _layer_types(model)
    flags = [getattr(inner, name, False) for name in ("is_sliding", "use_sliding_window", "is_local")]
    sliding = any(bool(f) for f in flags) or bool(getattr(layer, "use_sliding", False))
    sliding = sliding or (types is not None and types[first_layer(model) + i] == "sliding_attention")
    if not sliding:
        return None
    window = getattr(model.args, "sliding_window", None) or getattr(model.model, "window_size", None)
    if not window:
        raise ValueError(f"layer {i} is a sliding-window layer but the config gives no sliding_window")
    return int(window)


def _head_dim(inner: nn.Module, model: nn.Module, n_heads: int) -> int:
    head_dim = getattr(inner, "head_dim", None) or getattr(model.args, "head_dim", None)
    return int(head_dim or model.args.hidden_size // n_heads)


def attention_traits(model: nn.Module, i: int) -> AttentionTraits:
    """Layer i's traits, from mlx-lm's attention module `model.model.layers[i].self_attn` (or ours,
    which keeps the original as `inner`)."""
    inner = model.model.layers[i].self_attn
    inner = getattr(inner, "inner", inner)
    n_heads = int(_first(inner, "n_heads", "num_heads", "num_attention_heads"))  # type: ignore[call-overload]
    n_kv_heads = int(_first(inner, "n_kv_heads", "num_key_value_heads"))  # type: ignore[call-overload]
    check_rope(getattr(inner, "rope", None), i)
    softcap = getattr(inner, "attn_logit_softcapping", None)
    sources = getattr(model.model, "previous_kvs", None)
    return AttentionTraits(
        layer=i,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=_head_dim(inner, model, n_heads),
        scale=float(_first(inner, "scale", "sm_scale")),  # type: ignore[arg-type]
        window=_window(model, i, inner),
        softcap=float(softcap) if softcap else None,
        has_sinks="sinks" in inner,
        kv_source=int(sources[first_layer(model) + i]) - first_layer(model) if sources is not None else i,
        position_scale=_position_scale(inner),
        rotary=bool(getattr(inner, "use_sliding_window", True)) and bool(getattr(inner, "use_rope", True)),
    )


def _position_scale(inner: nn.Module) -> tuple[float, int] | None:
    beta = getattr(inner, "scaling_beta", None)
    if beta is None:
        return None
    return float(beta), int(inner.original_max_position_embeddings)


def all_traits(model: nn.Module) -> list[AttentionTraits]:
    """The traits of every layer with a `self_attn` (other token mixers, e.g. recurrent ones, have none)."""
    return [attention_traits(model, i) for i, layer in enumerate(model.model.layers) if "self_attn" in layer]
