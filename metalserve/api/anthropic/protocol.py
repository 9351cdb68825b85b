"""Pydantic models of Anthropic Messages requests; unknown fields are refused, never dropped."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from metalserve.lora.request import MAX_LORA_SCALE


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """Accepted on any block: metalserve caches every prompt prefix anyway (see README)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # this server never cites; a client echoing a null back is fine


class ImageBlock(_Strict):
    """An image: `source` {"type": "base64", "media_type", "data"} (a "url" source is refused: the server
    fetches nothing); read by metalserve/api/images.py, for vision-language models only."""

    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class Message(_Strict):
    role: Literal["user", "assistant", "system"]  # a system turn mid-conversation (text blocks only)
    content: str | list[ContentBlock]


class Tool(_Strict):
    type: Literal["custom"] | None = None  # server tools (web search, bash, ...) are not offered
    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None  # as chat's function `strict`: forced calls always follow the schema
    defer_loading: bool | None = None  # deferred: left out of the prompt (and so not callable) until loaded
    eager_input_streaming: bool | None = None  # input_json_delta goes out as the model writes it anyway


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    """enabled / disabled turn the template's thinking on or off; adaptive leaves it to the model."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(default=None, ge=1024)
    # summarized (or absent): the reasoning as the model wrote it; omitted: thinking blocks stay empty.
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """Structured output (through the grammar) and effort (the template's reasoning_effort)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class ThinkingTurns(_Strict):
    type: Literal["thinking_turns"]
    value: StrictInt = Field(ge=1)


class ClearThinking(_Strict):
    """Drop the thinking of all but the last `keep` assistant turns from the prompt ("all": keep every one)."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns = ThinkingTurns(type="thinking_turns", value=1)


class ContextManagement(_Strict):
    edits: list[ClearThinking]


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """What decides the prompt: the body of /v1/messages/count_tokens and the base of a Messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    # llama.cpp's per-request LoRA scale, for a `model` that names an adapter (docs/lora.md)
    lora_scale: float | None = Field(default=None, ge=0.0, le=MAX_LORA_SCALE, allow_inf_nan=False)
