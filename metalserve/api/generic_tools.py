"""Tools for chat templates that do not render them (SmolLM2's, for one), as llama.cpp's server does.

At start-up `template_renders_tools` renders a probe conversation with and without a probe tool; where
both come out the same, the template would drop every tool silently. Then each request with tools gets
them in a generic form instead: the tool list as JSON Schema and instructions for a call block in the
system message, earlier calls and results as text in that same form, and calls read back by the
`generic` tool parser (api/tool_parsers/generic.py). `--no-generic-tool-prompt` turns this off.

The form (see docs/agents.md): one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per
call; results come back in a user turn as `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
from typing import Any

from metalserve.api.tool_parsers.generic import CALL_CLOSE, CALL_OPEN

_PROBE_NAME = "metalserve_probe_tool"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_PROBE_MESSAGES = [{"role": "user", "content": "hello"}]

TOOLS_HEADER = (
    "# Tools\n\n"
    "You can call the functions below to help with the user's request. Each is described as JSON "
    "Schema:\n<tools>\n"
)
TOOLS_FOOTER = (
    "</tools>\n\n"
    "To call a function, reply with one block per call, each holding a JSON object with the function's "
    "name and its arguments:\n"
    f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}\n{CALL_CLOSE}\n'
    "Each result comes back in a later message inside <tool_response></tool_response>. When no "
    "function is needed, answer in plain text."
)


def template_renders_tools(tokenizer: Any, template: str | None) -> bool:
    """Whether the chat template shows a tool list to the model: rendered with a probe tool and without,
    the two prompts differ. A template that fails on the probe counts as rendering them (it reads them)."""
    if not template:
        return True  # no template: every chat request is refused anyway

    def render(tools: list[dict[str, Any]] | None) -> str:
        return str(
            tokenizer.apply_chat_template(
                _PROBE_MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False, chat_template=template
            )
        )

    try:
        return render([_PROBE_TOOL]) != render(None)
    except Exception:
        return True


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The tool list and the call instructions, as the system message says them."""
    listed = "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools)
    return TOOLS_HEADER + listed + TOOLS_FOOTER


def with_generic_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: the tools in the system message (a new one
    first if there is none), earlier calls as call blocks in the assistant's text and tool results as
    user turns. `tools` None leaves the system message alone but still rewrites the history."""
    out = [_plain(m) for m in messages]
    if tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return _merge_user_turns(out)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """One message with its tool parts as text."""
    if message["role"] == "tool":
        content = message.get("content") or ""
        if isinstance(content, list):  # parts (a screenshot tool's image): kept as parts around the text
            return {"role": "user", "content": [_text("<tool_response>\n"), *content, _text("\n</tool_response>")]}
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        f"{CALL_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}\n"
        f"{CALL_CLOSE}"
        for c in calls
    ]
    text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    rest = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
    return {**rest, "content": text}


def _merge_user_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent user turns (several tool results, or results then text) as one, for templates that expect
    the roles to alternate."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if out and message["role"] == "user" and out[-1]["role"] == "user":
            before, after = out[-1]["content"], message["content"]
            if isinstance(before, list) or isinstance(after, list):  # image parts stay parts
                joined: Any = [*_parts(before), _text("\n"), *_parts(after)]
            else:
                joined = f"{before}\n{after}"
            out[-1] = {**out[-1], "content": joined}
        else:
            out.append(message)
    return out


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as a list of parts (a string is one text part)."""
    if isinstance(content, list):
        return content
    return [_text(content)] if content else []
