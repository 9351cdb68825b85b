"""A Responses request in the chat pipeline's form: instructions, the item history, tools, text.format."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from metalserve.api.errors import OpenAIError
from metalserve.api.protocol import ChatCompletionRequest
from metalserve.api.responses.protocol import (
    FunctionCallItem,
    FunctionTool,
    ImageContent,
    InputItem,
    MessageItem,
    NamespaceTool,
    ReasoningItem,
    ResponsesRequest,
    TextContent,
)

_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
NO_FILES = "input_file parts are not supported: send text, or images as input_image data URLs"


def conversation(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every input item of this turn as plain dicts: the previous response's history, then the new input."""
    if isinstance(req.input, str):
        new = [{"type": "message", "role": "user", "content": req.input}]
    else:
        new = [item.model_dump(exclude_none=True, by_alias=True) for item in req.input]
    return history + new


def to_chat(req: ResponsesRequest, items: list[dict[str, Any]], *, reasoning: bool) -> ChatCompletionRequest:
    """The chat request this Responses request means; anything it cannot mean is a 400 naming it."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _messages(_ITEMS.validate_python(items))
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "stream": req.stream,
        "lora_scale": req.lora_scale,
    }
    functions = [t for t, _ in flat_tools(req) if not t.defer_loading]
    if functions:
        fields["tools"] = [
            {"function": t.model_dump(exclude={"type", "defer_loading"}, exclude_none=True)} for t in functions
        ]
    fields.update(_tool_choice(req))
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    fields.update(_text_format(req))
    if req.reasoning is not None and req.reasoning.effort is not None:
        if not reasoning and req.reasoning.effort != "none":
            raise OpenAIError(
                "reasoning.effort needs the server started with --reasoning-parser", 400, param="reasoning"
            )
        # gpt-oss templates read reasoning_effort; <think> templates turn thinking on or off.
        kwargs = {"reasoning_effort": req.reasoning.effort, "enable_thinking": req.reasoning.effort != "none"}
        fields["chat_template_kwargs"] = kwargs
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise OpenAIError(f"invalid request: {first.get('msg')}", 400) from None


def flat_tools(req: ResponsesRequest) -> list[tuple[FunctionTool, str | None]]:
    """Every function tool with its namespace (None at top level); a name may be given only once."""
    out: list[tuple[FunctionTool, str | None]] = []
    for tool in req.tools or []:
        if isinstance(tool, NamespaceTool):
            about = f"[{tool.name}] {tool.description or ''}".strip()
            for t in tool.tools:
                description = f"{about}: {t.description}" if t.description else about
                out.append((t.model_copy(update={"description": description}), tool.name))
        else:
            out.append((tool, None))
    names = [t.name for t, _ in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise OpenAIError(f"tools: function names given more than once: {repeated}", 400, param="tools")
    return out


def namespaces(req: ResponsesRequest) -> dict[str, str]:
    """Function name -> namespace, for the function_call items of namespaced tools."""
    return {t.name: ns for t, ns in flat_tools(req) if ns is not None}


def _messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Items to chat messages; a turn's reasoning, text and calls become one assistant message."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning.append("".join(c.text for c in item.content or []) or "".join(s.text for s in item.summary))
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _content(item.content, f"input.{i}.content")})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            call_ids.add(item.call_id)
        else:
            if item.call_id not in call_ids:
                raise OpenAIError(
                    f"input.{i}: function_call_output for call_id {item.call_id!r}, which no function_call made",
                    400,
                    param=f"input.{i}.call_id",
                )
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        if reasoning and out and out[-1]["role"] == "assistant" and not isinstance(item, ReasoningItem):
            out[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
    return out


def _text(content: str | list[TextContent | ImageContent] | list[TextContent]) -> str:
    if isinstance(content, str):
        return content
    # Joined as the chat API joins text parts (and vLLM, and llama.cpp's Responses endpoint): Codex sends its
    # developer message as several parts, which glued together ran one tag into the next.
    return "\n".join(part.text for part in content if isinstance(part, TextContent))


def _content(content: str | list[TextContent | ImageContent], path: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: text joined, or with images the chat's text and image parts."""
    if isinstance(content, str) or not any(isinstance(part, ImageContent) for part in content):
        return _text(content)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, TextContent):
            parts.append({"type": "text", "text": part.text})
        elif part.type == "input_file":
            raise OpenAIError(NO_FILES, 400, param=f"{path}.{j}")
        elif part.image_url is None:
            raise OpenAIError(
                "could not process image: input_image needs image_url (a data URL); file_id is not supported "
                "(this server keeps no files)",
                400,
                param=f"{path}.{j}",
            )
        else:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


def _tool_choice(req: ResponsesRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if choice is None:
        return {}
    if isinstance(choice, str):
        if choice == "required" and not req.tools:
            raise OpenAIError('tool_choice "required" needs tools', 400, param="tool_choice")
        return {"tool_choice": choice}
    if choice.name not in {t.name for t, _ in flat_tools(req) if not t.defer_loading}:
        raise OpenAIError(
            f"tool_choice names function {choice.name!r}, which is not in tools", 400, param="tool_choice"
        )
    return {"tool_choice": {"type": "function", "function": {"name": choice.name}}}


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    """text.format onto chat's response_format (json_schema and json_object go through the grammar)."""
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.schema_ is None or not fmt.name:
        raise OpenAIError("text.format json_schema needs a name and a schema", 400, param="text.format")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {
        "response_format": {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}
    }
