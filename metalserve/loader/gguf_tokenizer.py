"""A Hugging Face fast tokenizer built from a GGUF file's tokenizer metadata.

transformers' `AutoTokenizer.from_pretrained(..., gguf_file=...)` reads the file through a torch-based
reader; the metadata is already in hand from `mx.load`, so it is handed to transformers' torch-free
converter directly (the same conversion, so token ids match transformers' GGUF loader).
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.gguf_metadata import scalar, to_python

# GGUF metadata key (under "tokenizer.ggml.") -> the name transformers' converter expects.
_TOKENIZER_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}
_SPECIALS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unk_token_id",
    "pad_token": "pad_token_id",
}


def _tokenizer_dict(metadata: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in _TOKENIZER_KEYS.items():
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            continue
        out[name] = value if isinstance(value, (str, list)) else to_python(value)
    if not out.get("tokens"):
        raise ModelLoadError("The GGUF file has no tokenizer.ggml.tokens: it carries no tokenizer.")
    return out


def tokenizer_from_gguf(metadata: dict[str, Any], architecture: str) -> PreTrainedTokenizerBase:
    """Convert the vocabulary, merges and special tokens into a PreTrainedTokenizerFast."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as exc:  # the module moved in transformers 5 (4.x had integrations/ggml.py)
        import transformers

        raise ModelLoadError(
            f"transformers {transformers.__version__} cannot convert a GGUF tokenizer without torch; "
            "install transformers>=5.0 (`pip install -U transformers`)."
        ) from exc

    tok = _tokenizer_dict(metadata)
    try:
        backend, _ = convert_gguf_tokenizer(architecture, tok)
    except ValueError as exc:
        raise ModelLoadError(f"Cannot build the tokenizer from the GGUF metadata: {exc}") from exc
    tokens: list[str] = tok["tokens"]
    specials = {name: tokens[tok[key]] for name, key in _SPECIALS.items() if key in tok}
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    add_bos_token = bool(scalar(add_bos)) if add_bos is not None else tok.get("tokenizer_type") == "llama"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=add_bos_token,
        **specials,
    )
