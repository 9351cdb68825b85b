"""What a successful load hands to the rest of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # keep `import metalserve.loader` free of MLX (the BLAS must load first)
    import mlx.core as mx
    import mlx.nn as nn
    from transformers import PreTrainedTokenizerBase

    from metalserve.kernels.cpu.packed_codes import PackedCodes
    from metalserve.loader.gguf_codes import FileRows


@dataclass
class LoadedModel:
    """An mlx-lm model with its tokenizer, chat template, EOS ids and config: what was read, nothing more.

    What the model's family makes of it (its KV shape, activation dtype, layers) is the executor's
    (executor/models/families.py)."""

    model: nn.Module  # an mlx-lm model: .model.embed_tokens, .model.layers[i].self_attn, ...
    tokenizer: PreTrainedTokenizerBase
    model_type: str  # the config's; executor/models/families.py says what a type is and whether it is served
    config: dict[str, Any]  # HF-style config
    max_model_len: int
    eos_token_ids: frozenset[int]
    chat_template: str | None
    source: str  # what was loaded: a path, a repo id, or "embedded default: <path>"
    weights_desc: str  # e.g. "fp32 (dequantized from Q4_1, 540 MB)"
    blas_desc: str
    # The packed codes of quantized layers by module path, kept on MLX's CPU backend for the host path:
    # beside their fp32 copies (dequantized), or alone (a GGUF for the fast path: the modules read them).
    # The executor drops those beside fp32 copies for a family that does not take the host path.
    codes: dict[str, PackedCodes | FileRows] = field(default_factory=dict)
    # A vision-language model: the whole mlx-vlm model (`model` is its language model) and the processor
    # that turns images into pixels and placeholder tokens (metalserve/multimodal/processor.py); else None.
    vision: nn.Module | None = None
    image_processor: Any = None
    # The context a RoPE scaling from --hf-overrides stretches max_model_len (the trained one) to; None: none.
    rope_scaled_len: int | None = None

    def describe(self) -> str:
        """One line for the start-up log: which model, which weights path, which BLAS."""
        return f"model {self.source}: {self.model_type}, weights {self.weights_desc}, BLAS {self.blas_desc}"


@dataclass
class RawModel:
    """A model's parts before an mlx-lm object is built: config, MLX-layout weights and tokenizer."""

    config: dict[str, Any]
    weights: dict[str, mx.array]
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    stored_as: str  # e.g. "Q4_1" or "4-bit affine (group 64)" or "bfloat16"
    # A vision-language model comes built by mlx-vlm (weights already in it) with its image processor.
    prebuilt: nn.Module | None = None
    image_processor: Any = None
    # Quantized matrices kept in their codes (the CPU fast path) by module path; their tensors in
    # `weights` are lazy stand-ins that metalserve.loader.codes_linear.swap_in_codes replaces.
    codes: dict[str, PackedCodes | FileRows] = field(default_factory=dict)
