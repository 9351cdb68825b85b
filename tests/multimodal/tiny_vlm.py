"""Tiny random-weight Qwen2-VL / Qwen2.5-VL models built with mlx-vlm's own classes, with a byte-level
tokenizer that knows the vision tokens and a Qwen2-VL-style chat template; nothing from a hub."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mlx-vlm's processors look on the hub for missing files

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.loader.tiny_tokenizer import MERGES, byte_alphabet

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|video_pad|>",
]
ENDOFTEXT, IM_START, IM_END, VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = range(len(SPECIALS))
VOCAB = 320  # > the tokenizer's 269 entries
# Qwen2-VL's template in outline: an image part becomes <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@lru_cache(maxsize=1)
def vl_tokenizer() -> PreTrainedTokenizerFast:
    tokens = SPECIALS + byte_alphabet() + ["".join(m) for m in MERGES]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def config(model_type: str = "qwen2_vl") -> dict[str, Any]:
    if model_type == "qwen2_vl":
        vision = {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "mlp_ratio": 2,
        }
    else:
        vision = {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        }
    return {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": IMAGE_PAD,
        "video_token_id": VIDEO_PAD,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
        "vision_token_id": VISION_START,
        "eos_token_id": [IM_END],
        "bos_token_id": ENDOFTEXT,
        "vision_config": vision,
    }


def build(model_type: str = "qwen2_vl", seed: int = 0) -> nn.Module:
    """The mlx-vlm model for `config(model_type)`, with random fp32 weights (scaled so logits vary)."""
    import importlib

    from mlx_vlm.utils import update_module_configs

    module = importlib.import_module(f"mlx_vlm.models.{model_type}")
    cfg = config(model_type)
    model_config = update_module_configs(module.ModelConfig.from_dict(cfg), module, cfg, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    model.set_dtype(mx.float32)
    model.eval()
    mx.eval(model.parameters())
    return model


def save(model: nn.Module, model_type: str, directory: Path) -> Path:
    """A model directory as mlx-community publishes VLMs: config.json, weights, tokenizer, preprocessor."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(model_type)))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    vl_tokenizer().save_pretrained(str(directory))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    pre = {
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": 14 * 14 * 4 * 1280,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(pre))
    return directory
