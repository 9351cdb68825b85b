"""Images in chat messages: read, checked against the limits and placed for the chat template.

Every chat-form API comes here: OpenAI `image_url` parts directly, Anthropic `image` blocks and Responses
`input_image` parts as the data-URL parts their translations make. A model without a vision tower
refuses images; every refusal is a 400 whose message says "could not process image" and names where
the image was (`messages[i].content[j]`), the wording Claude Code drops an image on and goes on.
"""

from __future__ import annotations

from typing import Any

from metalserve.api.errors import OpenAIError
from metalserve.api.protocol import ChatMessage, ImageURLPart, TextPart
from metalserve.multimodal.images import DecodedImage, ImageBudget, ImageError, decode_base64, split_data_url
from metalserve.multimodal.limits import ImageLimits

NO_VISION = "this model takes no images (it has no vision tower); send text only"


def image_error(message: str, path: str) -> OpenAIError:
    text = message if message.startswith("could not process image") else f"could not process image: {message}"
    return OpenAIError(f"{text} ({path})", 400, param=path, code="invalid_image")


def read_images(messages: list[ChatMessage], limits: ImageLimits, takes_images: bool) -> list[DecodedImage]:
    """Every image part, in conversation order, decoded; OpenAIError (400) for the first that fails."""
    budget = ImageBudget(limits)
    images: list[DecodedImage] = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if not isinstance(part, ImageURLPart):
                continue
            path = f"messages[{i}].content[{j}]"
            if not takes_images:
                raise image_error(NO_VISION, path)
            try:
                media_type, data = split_data_url(part.image_url.url)
                images.append(budget.take(decode_base64(data, media_type)))
            except ImageError as exc:
                raise image_error(str(exc), path) from None
    return images


def template_content(message: ChatMessage) -> str | list[dict[str, Any]]:
    """The content as chat templates take it: text joined, or (with images) parts where each image is
    `{"type": "image"}`, the part vision-language templates turn into the model's image token."""
    content = message.content
    if not isinstance(content, list):
        return content or ""
    if not any(isinstance(p, ImageURLPart) for p in content):
        return "\n".join(p.text for p in content if isinstance(p, TextPart))
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in content]


def content_chars(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, list):
        return sum(len(part.text) for part in content if isinstance(part, TextPart))
    return len(content or "")
