"""A Messages request in the chat pipeline's form: system, turns, tool calls and results, tools, sampling."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from metalserve.api.anthropic.protocol import (
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
)
from metalserve.api.errors import OpenAIError
from metalserve.api.protocol import ChatCompletionRequest

NO_IMAGES = "could not process image: image blocks go in user messages and tool results only"


def to_chat(req: CountTokensRequest, *, reasoning: bool) -> ChatCompletionRequest:
    """The chat request this Messages request means; anything it cannot mean is a 400 naming it."""
    messages = _system(req.system) + _turns(req.messages)
    for edit in req.context_management.edits if req.context_management else []:
        if edit.keep != "all":
            _clear_thinking(messages, edit.keep.value)
    fields: dict[str, Any] = {"model": req.model, "messages": messages}
    fields.update(_tools(req))
    kwargs = _template_kwargs(req, reasoning)
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    config = req.output_config
    if config is not None and config.format is not None:
        schema = {"name": "output", "schema": config.format.schema_, "strict": True}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if isinstance(req, MessagesRequest):
        fields.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            stream=req.stream,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            user=req.metadata.user_id if req.metadata else None,
            lora_scale=req.lora_scale,
        )
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        raise OpenAIError(f"invalid request: {exc.errors()[0].get('msg')}", 400) from None


def _template_kwargs(req: CountTokensRequest, reasoning: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if req.thinking is not None and req.thinking.type != "adaptive":
        kwargs["enable_thinking"] = _thinking(req, reasoning)
    if req.output_config is not None and req.output_config.effort is not None:
        kwargs["reasoning_effort"] = req.output_config.effort
    return kwargs


def _clear_thinking(messages: list[dict[str, Any]], keep: int) -> None:
    """context_management's clear_thinking: only the last `keep` thinking turns keep their reasoning."""
    thinking = [m for m in messages if m.get("reasoning_content")]
    for message in thinking[: max(len(thinking) - keep, 0)]:
        del message["reasoning_content"]


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [{"role": "system", "content": text}]


def _turns(turns: list[Message]) -> list[dict[str, Any]]:
    if turns[-1].role == "assistant":
        raise OpenAIError("a final assistant message (response prefill) is not supported; end with a user message", 400)
    out: list[dict[str, Any]] = []
    previous_ids: set[str] = set()
    for i, turn in enumerate(turns):
        blocks = [TextBlock(type="text", text=turn.content)] if isinstance(turn.content, str) else turn.content
        if turn.role != "user" and any(isinstance(b, ImageBlock) for b in blocks):
            raise OpenAIError(f"{NO_IMAGES} (messages.{i})", 400)
        if turn.role == "system":
            if not all(isinstance(b, TextBlock) for b in blocks):
                raise OpenAIError(f"messages.{i}: system messages hold text blocks only", 400)
            out += _system([b for b in blocks if isinstance(b, TextBlock)])
        elif turn.role == "assistant":
            message, previous_ids = _assistant(blocks)
            out.append(message)
        else:
            out += _user(blocks, previous_ids, i)
            previous_ids = set()
    return out


def _assistant(blocks: list[Any]) -> tuple[dict[str, Any], set[str]]:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    if thinking:
        message["reasoning_content"] = thinking
    uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
    if uses:
        message["tool_calls"] = [
            {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
            for u in uses
        ]
    if any(isinstance(b, ToolResultBlock) for b in blocks):
        raise OpenAIError("tool_result blocks belong in user messages, not assistant ones", 400)
    return message, {u.id for u in uses}


def _user(blocks: list[Any], tool_use_ids: set[str], index: int) -> list[dict[str, Any]]:
    """Tool results become tool messages (in order); the text around them one user message each."""
    out: list[dict[str, Any]] = []
    text: list[dict[str, Any]] = []  # the user content parts since the last tool result
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in tool_use_ids:
                raise OpenAIError(
                    f"messages.{index}: tool_result block for tool_use id {block.tool_use_id!r}, which is not "
                    "in the previous assistant message",
                    400,
                )
            if text:
                out.append({"role": "user", "content": _content(text)})
                text = []
            path = f"messages.{index}.content.{j}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_content(block, path)})
        elif isinstance(block, TextBlock):
            text.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            text.append(_image_part(block, f"messages.{index}.content.{j}"))
        else:
            raise OpenAIError(f"messages.{index}: {block.type} blocks belong in assistant messages", 400)
    if text or not out:
        out.append({"role": "user", "content": _content(text)})
    return out


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text blocks joined into one string (as before images); with an image, the parts as they are."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image_part(block: ImageBlock, path: str) -> dict[str, Any]:
    """An image block as the chat part it means: a base64 source becomes a data URL (read later, with
    the limits); a URL source is refused, since the server fetches nothing."""
    source = block.source
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if kind == "url":
        why = "image URLs are not fetched: this server reaches no network; send the image as base64"
    else:
        why = 'an image source must be {"type": "base64", "media_type": ..., "data": ...}'
    raise OpenAIError(f"could not process image: {why} ({path}.image)", 400)


def _result_content(block: ToolResultBlock, path: str) -> str | list[dict[str, Any]]:
    content: str | list[dict[str, Any]] | None = None
    if isinstance(block.content, list):
        parts = [
            _image_part(b, f"{path}.content.{k}") if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
            for k, b in enumerate(block.content)
        ]
        content = _content(parts)
    else:
        content = block.content
    # The template has no error flag, so a failed tool says so in its text.
    if not block.is_error:
        return content or ""
    if isinstance(content, list):
        return [{"type": "text", "text": "Error: "}, *content]
    return f"Error: {content or ''}"


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    """tools and tool_choice: auto -> auto, any -> required, tool -> named, none -> none."""
    tools = [t for t in req.tools or [] if not t.defer_loading]
    out: dict[str, Any] = {}
    if tools:
        out["tools"] = [{"function": _function(t)} for t in tools]
    choice = req.tool_choice
    if choice is None:
        return out
    if choice.type in ("any", "tool") and not tools:
        raise OpenAIError(f'tool_choice "{choice.type}" needs tools', 400)
    if choice.type == "tool":
        if choice.name not in {t.name for t in tools}:
            raise OpenAIError(f"tool_choice names tool {choice.name!r}, which is not in tools", 400)
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice.name is not None:
        raise OpenAIError(f'tool_choice "{choice.type}" takes no name', 400)
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _function(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return function if tool.strict is None else {**function, "strict": tool.strict}


def _thinking(req: CountTokensRequest, reasoning: bool) -> bool:
    """Extended thinking maps onto the template's enable_thinking; it needs a reasoning parser to show."""
    assert req.thinking is not None
    if req.thinking.type == "disabled":
        return False
    if not reasoning:
        raise OpenAIError("thinking needs the server started with --reasoning-parser", 400)
    budget = req.thinking.budget_tokens
    if budget is None:
        raise OpenAIError("thinking.budget_tokens is required when thinking is enabled", 400)
    if isinstance(req, MessagesRequest) and budget >= req.max_tokens:
        raise OpenAIError("thinking.budget_tokens must be less than max_tokens", 400)
    return True
