"""The one place that knows a model family: which `model_type`s are served and what each one is.

A family answers: is it supported (each has a golden test in tests/models/), is it a hybrid (recurrent-
state layers beside attention, models/hybrid.py), does it keep MLA's latent pages (models/mla.py), may
it take the host fast path (executor/host/: dense llama-family blocks only). From those follow what a
loaded model of the family looks like to the engine: its embedding and activation dtype, its KV layout
(sliding windows included) and its recurrent-state layers. Everything else asks here rather than
testing `model_type` itself. The KV cache's bytes per block are the layout's business (kv_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from metalserve.executor.attention.base import dtype_name
from metalserve.executor.models.attention_traits import all_traits
from metalserve.executor.models.hybrid import state_layout_of
from metalserve.executor.models.hybrid_families import FAMILIES, Family, attention_shape, embedding_of, mixers_of
from metalserve.executor.models.kv_layout import KVLayout, hybrid_kv_layout, mla_kv_layout, model_kv_layout
from metalserve.executor.models.mla import latent_kv_shape
from metalserve.kernels.cpu.decoder_weights import HOST_MODEL_TYPES
from metalserve.kvcache.specs import KVCacheDtype, KVCacheSpec, PageDtype, RecurrentState, SlidingWindow

if TYPE_CHECKING:
    from metalserve.config import EngineConfig
    from metalserve.executor.state_cache import StateLayout
    from metalserve.loader import LoadedModel

# mistral loads as llama in mlx-lm. Each type has a golden test in tests/models/ (tiny random weights,
# greedy tokens identical to mlx-lm's own generation).
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma3_text",
    "gemma4_text",
    "gpt_oss",
    "phi3",
    "olmo2",
    "granite",
    "qwen2_moe",
    "olmo3",
    "granitemoe",
    "gemma2",
    "smollm3",
    "glm4",
    "starcoder2",
    "ministral3",
    "seed_oss",
    "internlm3",
    "olmoe",
    "phimoe",
    "ernie4_5",
    "cohere2",
    "exaone4",
    # Hybrids with recurrent-state layers: hybrid_families.FAMILIES says where each keeps its parts.
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "lfm2_moe",
    "nemotron_h",
    "granitemoehybrid",
    # MLA, latent pages:
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    # Vision-language models (mlx-vlm's classes): the language model here, the tower in executor/encoders/.
    "qwen2_vl",
    "qwen2_5_vl",
    "gemma3",
)
# Images in (metalserve/multimodal/); these also take multimodal RoPE positions [3, T] (models/mrope_attention.py).
VISION_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "gemma3"})
MROPE_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
# The tokens of one image attend to each other both ways (HF's Gemma 3 token_type_ids mask): the MLX-ops
# attention honours it, and the scheduler never splits an image across prefill chunks.
BIDIRECTIONAL_IMAGE_MODEL_TYPES = frozenset({"gemma3"})
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "glm4_moe_lite"})
# What mlx-lm's backbone does to the embedding before the first layer besides looking it up (granite's
# `embedding_multiplier` is read off the backbone): sqrt(hidden), or that factor rounded to bfloat16 first.
EMBEDDING_SCALES = {"gemma2": "sqrt", "gemma3_text": "sqrt-bf16"}
# Families whose layers pipeline stages cannot run apart as mlx-lm's backbone would, and why (the vision
# families too: images are not sent to the stages).
NOT_SPLIT = {"gemma4_text": "its layers take per-layer inputs that the backbone computes from the token ids"}
# HOST_MODEL_TYPES (metalserve/kernels/cpu/decoder_weights.py, where the loader reads it too): the dense
# llama-family models whose blocks the host twins reproduce (executor/host/); every other family runs
# mlx-lm's own modules on MLX.


class UnsupportedModelType(ValueError):
    """A model_type with no family here; the message lists the supported ones."""

    def __init__(self, model_type: str) -> None:
        super().__init__(f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


class KVShape(NamedTuple):
    """A loaded model's paged KV cache, as the pool sizing and the attention backend see it."""

    num_layers: int  # layers that keep K/V (a hybrid's attention layers only)
    num_kv_heads: int
    head_dim: int
    value_dim: int | None  # MLA's latent pages: K alone (one head of head_dim), V its first value_dim channels
    dtype: mx.Dtype  # the activations' dtype, and so the KV cache's


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    hybrid: Family | None  # where a hybrid keeps its backbone, head and mixers; None: attention layers only
    mla: bool  # MLA's latent pages instead of per-head K/V
    host_path: bool  # the host fast path may run it (where the Platform has one)
    vision: bool = False  # takes images: a vision tower beside the language model (mlx-vlm's classes)
    mrope: bool = False  # multimodal RoPE: three position rows per token (Qwen2-VL)
    bidirectional_images: bool = False  # an image's tokens attend to each other both ways (Gemma 3)
    embedding_scale: str | None = None  # EMBEDDING_SCALES
    not_split: str | None = None  # why pipeline stages cannot run it (None: they can)

    def language_model(self, model: nn.Module) -> nn.Module:
        """The module holding the backbone and the head (a wrapper's `language_model` for qwen3_5)."""
        return self.hybrid.language_model(model) if self.hybrid else model

    def backbone(self, model: nn.Module) -> nn.Module:
        """The module holding the embedding, the decoder layers and the final norm."""
        return getattr(self.language_model(model), self.hybrid.backbone_attr) if self.hybrid else model.model

    @property
    def embedding_attr(self) -> str:
        return self.hybrid.embed_attr if self.hybrid else "embed_tokens"

    def embed_inputs(self, embedded: mx.array, backbone: nn.Module) -> mx.array:
        """The embedding's output as mlx-lm's backbone feeds it to the first layer (a pipeline's rank 0
        runs its layers without the backbone's own call)."""
        if self.embedding_scale == "sqrt":
            return embedded * (backbone.args.hidden_size**0.5)
        if self.embedding_scale == "sqrt-bf16":
            return embedded * mx.array(backbone.args.hidden_size**0.5, mx.bfloat16).astype(embedded.dtype)
        multiplier = getattr(backbone, "embedding_multiplier", None)  # the granite families
        return embedded * multiplier if multiplier is not None else embedded

    def embedding(self, model: nn.Module) -> nn.Module:
        return embedding_of(model, self.model_type) if self.hybrid else model.model.embed_tokens

    def activation_dtype(self, model: nn.Module) -> mx.Dtype:
        """The dtype activations (and so the KV cache and recurrent states) take: the embedding's output's."""
        embed = self.embedding(model)
        return embed.scales.dtype if isinstance(embed, nn.QuantizedEmbedding) else embed.weight.dtype

    def kv_layout(self, model: nn.Module) -> KVLayout:
        """The KV layer groups and pool tensors (a hybrid keeps K/V for its attention layers only)."""
        if self.hybrid:
            return hybrid_kv_layout(model, self.model_type)
        if self.mla:
            layout = mla_kv_layout(model)
            if layout is None:
                raise ValueError(f"a {self.model_type} model without MLA attention is not supported")
            return layout
        return model_kv_layout(model)

    def sliding_windows(self, model: nn.Module) -> tuple[int, ...]:
        """The distinct sliding windows of its attention layers, in group order; () for full attention only."""
        groups = self.kv_layout(model).groups
        return tuple(dict.fromkeys(g.window for g in groups if isinstance(g, SlidingWindow)))

    def state_layers(self, model: nn.Module) -> tuple[int, ...]:
        """The recurrent-state layers (a hybrid's), in layer order; () for attention-only families."""
        if not self.hybrid:
            return ()
        return tuple(m.layer_idx for m in mixers_of(model, self.model_type) if m.kind == "state")

    def state_groups(self, model: nn.Module, layout: StateLayout | None = None) -> tuple[RecurrentState, ...]:
        """A hybrid's recurrent layers, in one group; a boundary state (conv + recurrent arrays) is the
        whole state, so it can be snapshotted for the prefix cache. Its slot is the state's bytes.
        `layout`: the states as already probed (PagedModel has it); None probes the model's mixers."""
        layers = self.state_layers(model)
        if not layers:
            return ()
        state_bytes = (layout or state_layout_of(model, self.model_type)).slot_bytes
        return (RecurrentState(layers=layers, snapshots=True, state_bytes=state_bytes),)

    def page(self, model: nn.Module, storage: KVCacheDtype = KVCacheDtype.AUTO) -> PageDtype:
        """How the model's K/V pages are stored: `storage` over the activation dtype."""
        dtype = self.activation_dtype(model)
        return PageDtype(dtype_name(dtype), dtype.size, storage)

    def kv_cache_spec(
        self, model: nn.Module, block_size: int, storage: KVCacheDtype = KVCacheDtype.AUTO, num_blocks: int = 0
    ) -> KVCacheSpec:
        """Every layer group's cache spec (kvcache/specs.py) for a model not yet installed (PagedModel's
        get_kv_cache_spec answers the same once it is)."""
        page = self.page(model, storage)
        return self.kv_layout(model).kv_cache_spec(page, block_size, self.state_groups(model), num_blocks)

    def kv_shape(self, model: nn.Module) -> KVShape:
        """Read off the built model, as the KV cache must match it."""
        dtype = self.activation_dtype(model)
        if self.hybrid:
            return KVShape(*attention_shape(model, self.model_type), None, dtype)
        layers = model.model.layers
        latent = latent_kv_shape(layers[0].self_attn) if self.mla else None
        if latent is not None:
            return KVShape(len(layers), 1, *latent, dtype)
        first = all_traits(model)[0]  # the families spell heads and head_dim differently
        return KVShape(len(layers), first.n_kv_heads, first.head_dim, None, dtype)


# Encoder pooling models (bidirectional, no KV): served through mlx-embeddings' classes, not as a paged
# decoder (metalserve/serving/encoder.py); only BERT is tested.
ENCODER_MODEL_TYPES = frozenset({"bert", "xlm-roberta", "modernbert"})


def is_encoder(model_type: str | None) -> bool:
    """Whether a config's model type is an encoder pooling model's."""
    return model_type in ENCODER_MODEL_TYPES


@cache
def model_family(model_type: str) -> ModelFamily:
    """The family of `model_type`; UnsupportedModelType for one not served."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelType(model_type)
    return ModelFamily(
        model_type,
        hybrid=FAMILIES.get(model_type),
        mla=model_type in MLA_MODEL_TYPES,
        host_path=model_type in HOST_MODEL_TYPES,
        vision=model_type in VISION_MODEL_TYPES,
        mrope=model_type in MROPE_MODEL_TYPES,
        bidirectional_images=model_type in BIDIRECTIONAL_IMAGE_MODEL_TYPES,
        embedding_scale=EMBEDDING_SCALES.get(model_type),
        not_split=NOT_SPLIT.get(model_type)
        or ("images are not sent to the stages" if model_type in VISION_MODEL_TYPES else None),
    )


def family_of(loaded: LoadedModel) -> ModelFamily:
    return model_family(loaded.model_type)


def kv_shape(loaded: LoadedModel) -> KVShape:
    """The loaded model's KV shape (see ModelFamily.kv_shape)."""
    return family_of(loaded).kv_shape(loaded.model)


def kv_cache_spec(
    loaded: LoadedModel, block_size: int, storage: KVCacheDtype = KVCacheDtype.AUTO, num_blocks: int = 0
) -> KVCacheSpec:
    """The loaded model's cache spec (see ModelFamily.kv_cache_spec)."""
    return family_of(loaded).kv_cache_spec(loaded.model, block_size, storage, num_blocks)


def check_supported(model_type: str) -> None:
    """For the loader, before it builds a model: UnsupportedModelType unless a family serves it."""
    model_family(model_type)


def load_model_for(config: EngineConfig, prepare: Callable[[nn.Module], None] | None = None) -> LoadedModel:
    """The config's model, loaded as the config says (weights mode, chat template, overrides) and refused
    unless its family is served; `prepare` sees the built model first (a pipeline rank keeps its layers)."""
    from metalserve.loader import load_model  # heavy (transformers, GGUF): only when a model is loaded

    return load_model(
        config.model,
        weights=config.weights,
        dequantize_max_bytes=config.dequantize_max_bytes,
        chat_template=config.chat_template,
        prepare=prepare,
        check_model_type=check_supported,
        hf_overrides=config.hf_overrides,
    )
