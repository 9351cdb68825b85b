"""Logprobs as the chat and completions APIs spell them (per-token strings cached, no -inf in JSON)."""

from __future__ import annotations

import math
from typing import Any

from metalserve.outputs import TokenLogprob


def safe_logprob(value: float) -> float:
    """JSON has no -inf; vLLM reports -9999.0 for impossible tokens."""
    return max(value, -9999.0) if math.isfinite(value) or value < 0 else 0.0


class TokenText:
    """Per-token strings for logprobs, cached per id (the same ids recur)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def for_request(self, as_token_ids: bool) -> TokenText | TokenIdText:
        """vLLM's `return_tokens_as_token_ids`: "token_id:N" strings, which name every token exactly
        (byte tokens that are not whole UTF-8 characters all decode to the same replacement character)."""
        return TOKEN_ID_TEXT if as_token_ids else self

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text


class TokenIdText:
    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


TOKEN_ID_TEXT = TokenIdText()


def chat_logprobs(entries: list[TokenLogprob], top_n: int, text: TokenText | TokenIdText) -> list[dict[str, Any]]:
    """The chat API's `logprobs.content` items for these tokens."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token = text(token_id)
        return {"token": token, "logprob": safe_logprob(logprob), "bytes": list(token.encode("utf-8"))}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:top_n]]} for e in entries]


def completion_logprobs(
    entries: list[TokenLogprob], top_n: int, text: TokenText | TokenIdText, offset: int
) -> dict[str, list[Any]]:
    """The completions API's column-wise logprobs; `offset` is where this piece starts in the text."""
    tokens = [text(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [safe_logprob(e.logprob) for e in entries],
        "top_logprobs": [{text(t): safe_logprob(lp) for t, lp in e.top[:top_n]} for e in entries],
        "text_offset": offsets,
    }


def prompt_logprobs_items(entries: list[TokenLogprob | None], text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first None) a map from token id to its logprob,
    rank and text, holding the prompt token itself and the top-k alternatives."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        own = {"logprob": safe_logprob(e.logprob), "rank": e.rank, "decoded_token": text(e.token_id)}
        item = {str(e.token_id): own}
        for rank, (t, lp) in enumerate(e.top, 1):
            item.setdefault(str(t), {"logprob": safe_logprob(lp), "rank": rank, "decoded_token": text(t)})
        out.append(item)
    return out


def echo_logprobs(
    prompt: list[int], entries: list[TokenLogprob | None], top_n: int, text: TokenText | TokenIdText
) -> dict[str, list[Any]]:
    """The OpenAI legacy form of `echo` with `logprobs`: the prompt's tokens as completion logprobs columns
    from offset 0, the first token's logprob and alternatives null."""
    tokens = [text(t) for t in prompt]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else safe_logprob(e.logprob) for e in entries],
        "top_logprobs": [
            None if e is None else {text(t): safe_logprob(lp) for t, lp in e.top[:top_n]} for e in entries
        ],
        "text_offset": offsets,
    }


def join_logprobs(first: dict[str, list[Any]], then: dict[str, list[Any]] | None) -> dict[str, list[Any]]:
    """Two column-wise logprobs pieces as one (the echoed prompt's, then the completion's)."""
    return first if then is None else {key: first[key] + then[key] for key in first}
