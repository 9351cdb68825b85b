"""A tiny byte-level BPE vocabulary, as a HF tokenizer directory and as GGUF tokenizer metadata."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    return sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)


def _byte_of(ch: str) -> int:
    # Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def vocab_tokens() -> list[str]:
    return SPECIALS + byte_alphabet() + ["".join(m) for m in MERGES]


def hf_tokenizer() -> PreTrainedTokenizerFast:
    tokens = vocab_tokens()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_hf_tokenizer(directory: Path) -> None:
    hf_tokenizer().save_pretrained(str(directory))


def add_gguf_tokenizer(writer: object) -> int:
    """Write gpt2-style tokenizer metadata into a GGUFWriter; returns the vocabulary size."""
    tokens = vocab_tokens()
    w = writer
    w.add_tokenizer_model("gpt2")  # type: ignore[attr-defined]
    w.add_tokenizer_pre("default")  # type: ignore[attr-defined]
    w.add_token_list(tokens)  # type: ignore[attr-defined]
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # type: ignore[attr-defined]
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])  # type: ignore[attr-defined]
    w.add_bos_token_id(1)  # type: ignore[attr-defined]
    w.add_eos_token_id(0)  # type: ignore[attr-defined]
    w.add_add_bos_token(False)  # type: ignore[attr-defined]
    w.add_chat_template(CHAT_TEMPLATE)  # type: ignore[attr-defined]
    return len(tokens)
