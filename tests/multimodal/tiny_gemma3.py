"""A tiny random-weight Gemma 3 (SigLIP tower, projector, gemma3 language model with a sliding-window
layer) built with mlx-vlm's own classes; prompts as token ids (the tokenizer is not under test here)."""

from __future__ import annotations

import importlib
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import mlx.nn as nn

from metalserve.loader.vision import language_model_of
from metalserve.multimodal.images import ImageLimits, open_image
from metalserve.multimodal.inputs import MultiModalInput
from metalserve.multimodal.processor import Gemma3ImageProcessor
from tests.models.golden import engine, loaded_of

VOCAB = 320
IMAGE, BOI, EOI, EOS = 300, 301, 302, 1
TOKENS_PER_IMAGE = 4  # a 56x56 image: 4x4 patches of 14, pooled 2x2
WINDOW = 8  # layer 0 slides over 8 tokens; layer 1 attends globally


def config() -> dict[str, Any]:
    return {
        "model_type": "gemma3",
        "image_token_index": IMAGE,
        "boi_token_index": BOI,
        "eoi_token_index": EOI,
        "pad_token_id": 0,
        "hidden_size": 64,
        "vocab_size": VOCAB,
        "eos_token_id": [EOS],
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": VOCAB,
            "sliding_window": WINDOW,
            "sliding_window_pattern": 2,
            "mm_tokens_per_image": TOKENS_PER_IMAGE,
            "query_pre_attn_scalar": 16,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
        },
    }


def build(seed: int = 0) -> nn.Module:
    from mlx_vlm.utils import update_module_configs

    module = importlib.import_module("mlx_vlm.models.gemma3")
    cfg = config()
    model_config = update_module_configs(module.ModelConfig.from_dict(cfg), module, cfg, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    # Gemma 3 ties its head to the embedding: mlx-vlm's loader (sanitize) makes it so on load.
    lm = model.language_model
    lm.lm_head.weight = lm.model.embed_tokens.weight
    model.set_dtype(mx.float32)
    model.eval()
    mx.eval(model.parameters())
    return model


def processor(tokenizer: Any = None) -> Gemma3ImageProcessor:
    """Without a tokenizer the prompts here are bare token ids (no blank lines are laid out around images)."""
    return Gemma3ImageProcessor.from_config(config(), None, tokenizer)


def prompt(token_ids: list[int], images: list[bytes]) -> tuple[list[int], list[MultiModalInput]]:
    """`token_ids` with one BOI per image, expanded by the processor."""
    return processor().process(token_ids, [open_image(data, ImageLimits()) for data in images])


def gemma3_engine(**overrides: Any) -> Any:
    vlm = build()
    loaded = loaded_of(language_model_of(vlm), "gemma3")
    loaded.vision, loaded.image_processor = vlm, processor()
    loaded.eos_token_ids = frozenset({EOS})
    return engine(loaded.model, "gemma3", loaded=loaded, **overrides)


def last_logits(vlm: nn.Module, seq: list[int], images: list[MultiModalInput], both_ways: bool = True) -> mx.array:
    """The last token's logits from mlx-vlm's own Gemma 3 modules with HF's mask: causal (and the
    sliding window on sliding layers), OR'd with "an image's tokens see each other" (HF's token_type_ids
    mask) when `both_ways`. No cache: the whole sequence in one call."""
    import numpy as np

    pixels = mx.array(np.concatenate([mm.data["pixel_values"] for mm in images]))
    lm = vlm.language_model
    backbone, hidden = lm.model, lm.config.hidden_size
    embeds = vlm.get_input_embeddings(mx.array([seq]), pixels, mask=mx.ones((1, len(seq)))).inputs_embeds
    h = embeds * mx.array(hidden**0.5, mx.bfloat16).astype(embeds.dtype)
    q, k = np.arange(len(seq))[:, None], np.arange(len(seq))[None, :]
    same_image = np.zeros((len(seq), len(seq)), bool)
    for mm in images if both_ways else ():
        same_image |= (q >= mm.offset) & (q < mm.end) & (k >= mm.offset) & (k < mm.end)
    for layer in backbone.layers:
        allowed = k <= q
        if layer.self_attn.is_sliding:
            allowed &= k > q - WINDOW
        mask = mx.array(np.where(allowed | same_image, 0.0, -np.inf).astype(np.float32))
        h = layer(h, mask, None)
    return lm.lm_head(backbone.norm(h))[0, -1]


def bidirectional_reference(vlm: nn.Module, tokens: list[int], images: list[MultiModalInput], n: int = 8) -> list[int]:
    """Greedy tokens of `last_logits` with HF's mask (mlx-vlm's own generation drops the image part and
    attends causally); the whole sequence again for every token."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(last_logits(vlm, tokens + out, images)).tolist()))  # type: ignore[arg-type]
    return out


def reference(vlm: nn.Module, tokens: list[int], images: list[MultiModalInput], n: int = 8) -> list[int]:
    """mlx-vlm's own greedy generation (it wants the 2-D attention mask for Gemma 3); causal."""
    import numpy as np
    from mlx_vlm.generate.ar import generate_step

    pixels = mx.array(np.concatenate([mm.data["pixel_values"] for mm in images])) if images else None
    mask = mx.ones((1, len(tokens)))
    steps = generate_step(mx.array([tokens]), vlm, pixels, mask, max_tokens=n, temperature=0.0)
    return [int(token) for token, _ in steps]


SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
IMAGE_SPECIALS = ["<image_soft_token>", "<start_of_image>", "<end_of_image>"]  # ids IMAGE, BOI, EOI
# Gemma 3's template in outline: an image part becomes <start_of_image>; only {"type": "image"} parts count.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma_tokenizer() -> Any:
    """A byte-level BPE with Gemma 3's special tokens, the image ones at IMAGE, BOI, EOI."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.loader.tiny_tokenizer import MERGES, byte_alphabet

    tokens = SPECIALS + byte_alphabet() + ["".join(m) for m in MERGES]
    tokens += [f"<unused{i}>" for i in range(IMAGE - len(tokens))] + IMAGE_SPECIALS
    assert tokens.index("<start_of_image>") == BOI
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[3:] + IMAGE_SPECIALS})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save(model: nn.Module, directory: Any) -> Any:
    """A Gemma 3 model directory: config.json, weights, tokenizer, template, preprocessor_config.json."""
    import json

    from mlx.utils import tree_flatten

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config()))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    gemma_tokenizer().save_pretrained(str(directory))
    # What HF's (and mlx-vlm's) Gemma3Processor reads: the image tokens by role, the image's token count.
    tokenizer_config = directory / "tokenizer_config.json"
    extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "extra_special_tokens": extra}))
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": TOKENS_PER_IMAGE}
    (directory / "processor_config.json").write_text(json.dumps(processor))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    pre = {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": 56, "width": 56},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(pre))
    return directory
