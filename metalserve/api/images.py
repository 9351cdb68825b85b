"""The refusal of an image sent to a text-only model, in words coding agents recover from.

Claude Code drops an image from the conversation and goes on only when the error says "could not
process image" or names the block's `messages.N.content.M...image` path; any other wording fails every
later turn of a conversation that once read an image. Vision models accept images instead (they call
this only where the model has no vision input)."""

from __future__ import annotations

from metalserve.api.errors import OpenAIError


def image_refused(path: str, param: str | None = None) -> OpenAIError:
    """A 400 for the image at `path` (e.g. `messages.3.content.1.image`, `input.0.content.2`)."""
    return OpenAIError(
        f"{path}: could not process image: this model takes text only (no vision input); send the image's "
        "content as text, or serve a vision model",
        400,
        param=param or path,
    )
