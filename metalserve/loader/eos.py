"""End-of-sequence ids and the chat template."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

# End-of-turn markers chat templates close a turn with; generation stops at them when the template uses them.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set)):
        return {int(v) for v in value}
    return {int(value)}


def _single_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    ids = tokenizer.encode(token, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase, config: dict[str, Any], chat_template: str | None
) -> frozenset[int]:
    """The config's and tokenizer's EOS, plus the end-of-turn tokens the chat template writes."""
    ids = _ids(config.get("eos_token_id")) | _ids(tokenizer.eos_token_id)
    for token in _TURN_END_TOKENS:
        if chat_template and token in chat_template:
            token_id = _single_token_id(tokenizer, token)
            if token_id is not None:
                ids.add(token_id)
    return frozenset(ids)
