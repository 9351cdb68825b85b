"""Pydantic models of Responses requests; unknown fields and item types are refused, never dropped.

Input items also accept the fields of the output items this server returns, so a client can send a
previous response's output back as input.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag

from metalserve.lora.request import MAX_LORA_SCALE

# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def _check_metadata(value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} key-value pairs are allowed, got {len(value)}")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters, got {len(key)}")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"values are at most {MAX_METADATA_VALUE_CHARS} characters, got {len(item)}")
    return value


Metadata = Annotated[dict[str, str], AfterValidator(_check_metadata)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextContent(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ImageContent(_Strict):
    """An image (`input_image`, a data URL in `image_url`: the server fetches nothing and keeps no files),
    for vision-language models; `input_file` is parsed so that it can be refused with a clear message."""

    type: Literal["input_image", "input_file"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sizes the image
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent | ImageContent]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # this server returns reasoning in plain text, never encrypted
    status: str | None = None


def _item_type(value: Any) -> str:
    """Items are told apart by `type`; a message may leave it out."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None  # deferred: left out of the prompt (and so not callable)


class NamespaceTool(_Strict):
    """A named group of function tools; their calls come back with the group's `namespace`."""

    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[FunctionTool]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Annotated[FunctionTool | NamespaceTool, Field(discriminator="type")]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: Metadata | None = None
    user: str | None = None
    # llama.cpp's per-request LoRA scale, for a `model` that names an adapter (docs/lora.md)
    lora_scale: float | None = Field(default=None, ge=0.0, le=MAX_LORA_SCALE, allow_inf_nan=False)
    # Reasoning always comes back in plain text (content), which serves what encrypted_content is for.
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    truncation: Literal["disabled"] | None = None
    prompt_cache_key: str | None = None  # every prefix is cached anyway
    client_metadata: dict[str, str] | None = None  # the client's own bookkeeping (Codex); no effect here
