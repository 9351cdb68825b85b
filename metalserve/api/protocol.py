"""Pydantic models of the OpenAI-compatible requests (responses are built as plain dicts)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from metalserve.lora.request import MAX_LORA_SCALE
from metalserve.sampling_params import MAX_LOGPROBS

MAX_N = 16  # choices per request; each is its own engine request
# Seeds and priorities are 64-bit signed integers, as vLLM checks them.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # e.g. continuous_usage_stats: not supported, so refused

    include_usage: bool = False


class ResponseFormat(BaseModel):
    """text, json_object or json_schema ({"name", "schema", "strict"}); the JSON modes go through the grammar."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and not isinstance((self.json_schema or {}).get("schema"), dict):
            raise ValueError('response_format type "json_schema" needs json_schema.schema, a JSON schema object')
        return self


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` field: exactly one of the constraints."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str  # a data URL (data:image/png;base64,...): the server fetches nothing
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sizes the image


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One message of the conversation; content parts are text and images (vision-language models only)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, for templates that render it


class _SamplingRequest(BaseModel):
    """Fields shared by chat and completions, including vLLM's extensions.

    Unknown fields are refused (400 naming the field): a request field is honoured or rejected, never dropped.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    seed: StrictInt | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: StrictInt = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: StrictInt = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    structured_outputs: StructuredOutputsRequest | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    # llama.cpp's per-request LoRA scale, for a `model` that names an adapter (docs/lora.md)
    lora_scale: float | None = Field(default=None, ge=0.0, le=MAX_LORA_SCALE, allow_inf_nan=False)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


PromptType = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's field: each prompt token's logprob and top-k (with `echo` and `logprobs`, the OpenAI legacy
    # form puts them in front of the completion's logprobs instead).
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: StrictInt | None = Field(default=None, ge=1)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages rendered as a chat request with the same tools and template
    arguments would be (so the count is the prompt that request would get)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]
