"""The one exception type every user-facing model-loading failure raises."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model that cannot be loaded. The message says what was wrong and what to do about it."""


class PromptTooLongError(ValueError):
    """A prompt that does not fit in the model's context window."""


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """Raise PromptTooLongError when the prompt (plus at least one new token) exceeds the context."""
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(
            f"The prompt has {num_prompt_tokens} tokens but the model's context length is {max_model_len} "
            "(room is needed for at least one generated token); shorten the prompt."
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"The prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
            f"context length of {max_model_len}; lower max_tokens or shorten the prompt."
        )
