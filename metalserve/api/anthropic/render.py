"""What the streamed and the whole Messages response share: ids, stop reasons, usage, the message shell."""

from __future__ import annotations

import json
from typing import Any

from metalserve.api.deltas import FinalOutput
from metalserve.api.partial_json import complete_partial_json
from metalserve.api.serving_common import ChoiceState

# OpenAI-side finish reasons in Anthropic's words (a matched stop string is checked first).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def tool_use_id(call_id: str) -> str:
    """Tool-call ids in Anthropic's style (toolu_...); any id works for the round trip."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop string that matched is `stop_sequence`."""
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic counts input_tokens without the cache reads; metalserve writes no separate cache entries."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def message_shell(message_id: str, model: str, usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object. Arguments cut by max_tokens (a forced call) give the
    object written so far, as Anthropic does; a value that is not an object is kept under "arguments"."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = complete_partial_json(arguments)
        if value is None:
            return {}
    return value if isinstance(value, dict) else {"arguments": value}


def message_body(
    message_id: str, model: str, final: FinalOutput, state: ChoiceState, omit_thinking: bool
) -> dict[str, Any]:
    """The non-streamed Messages response: thinking, text and tool_use blocks in that order."""
    content: list[dict[str, Any]] = []
    if final.reasoning:
        thinking = "" if omit_thinking else final.reasoning
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if final.content:
        content.append({"type": "text", "text": final.content})
    for call in final.tool_calls:
        content.append(
            {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": tool_input(call.arguments)}
        )
    body = message_shell(message_id, model, usage(state.num_prompt_tokens, state.num_cached_tokens, state.num_tokens))
    reason, sequence = stop_reason(final.finish_reason, state.stop_reason)
    return {**body, "content": content, "stop_reason": reason, "stop_sequence": sequence}
