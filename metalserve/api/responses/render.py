"""Response objects and output items, shared by the streamed and the whole Responses answer."""

from __future__ import annotations

import json
import uuid
from typing import Any

from metalserve.api.responses.protocol import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(rid: str, text: str, summary: bool, status: str = "completed") -> dict[str, Any]:
    """Reasoning in plain text; asked for a summary, the summary is the reasoning itself (none is made)."""
    summary_parts = [{"type": "summary_text", "text": text}] if summary and text else []
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": rid, "summary": summary_parts, "content": content, "status": status}


def message_item(mid: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    fid: str, call_id: str, name: str, arguments: str, status: str = "completed", namespace: str | None = None
) -> dict[str, Any]:
    item = {"type": "function_call", "id": fid, "call_id": call_id, "name": name, "arguments": arguments}
    if status == "completed" and not _is_json(arguments):
        status = "incomplete"  # a forced call cut by max_output_tokens: its arguments stop mid-way
    return {**item, "status": status, **({"namespace": namespace} if namespace else {})}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        # metalserve writes no separate cache entries: every computed block is cached as it goes.
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    rid: str,
    created_at: int,
    req: ResponsesRequest,
    model: str,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    cause: str | None = None,
) -> dict[str, Any]:
    """The response object; `status` incomplete carries the reason (the output budget ran out) and, as
    `cause`, which budget: the client's max_output_tokens, the server's --default-max-tokens, or the end
    of the context window (the SDK's `reason` has no word for the last two)."""
    fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format else None
    tool_choice = req.tool_choice
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens", "cause": cause} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": (req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None}),
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": fmt or {"type": "text"}},
        "tool_choice": tool_choice.model_dump()
        if tool_choice is not None and not isinstance(tool_choice, str)
        else (tool_choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }
