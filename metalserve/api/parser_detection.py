"""Tool-call and reasoning parsers read off the chat template when no flag names one, as llama.cpp's server
does: the template writes the markers the model was trained to emit, so they name the format."""

from __future__ import annotations

from typing import NamedTuple


class Detected(NamedTuple):
    """A parser name (None: none fits) and the template text that chose it, for the start-up log."""

    name: str | None
    because: str


# Most specific first: Qwen3-Coder's XML calls sit inside <tool_call> too, and harmony names both.
_TOOL_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "openai"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<|python_tag|>", "llama3_json"),
)
_REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "gpt_oss"),
    ("enable_thinking", "qwen3"),  # Qwen3's switch; its blocks are <think>...</think>
    ("<think>", "deepseek_r1"),
)


def _first(template: str | None, markers: tuple[tuple[str, str], ...]) -> Detected:
    for marker, name in markers:
        if template and marker in template:
            return Detected(name, f"the chat template writes {marker}")
    return Detected(None, "no known marker in the chat template")


def detect_tool_parser(template: str | None) -> Detected:
    """The tool-call parser whose format the template writes (None: no known call marker)."""
    return _first(template, _TOOL_MARKERS)


def detect_reasoning_parser(template: str | None) -> Detected:
    """The reasoning parser whose markers the template writes (None: the template does not think)."""
    return _first(template, _REASONING_MARKERS)


NONE = "none"  # `--tool-call-parser none` / `--reasoning-parser none`: no parser, and no detection


class ParserChoice(NamedTuple):
    tool_call_parser: str | None
    reasoning_parser: str | None
    log_line: str  # what the start-up log says was chosen, and why


def choose_parsers(tool_flag: str | None, reasoning_flag: str | None, template: str | None) -> ParserChoice:
    """The flags where given (`none`: no parser), else what the template's markers name."""
    parts = []
    chosen: list[str | None] = []
    for kind, flag, detect in (
        ("tool-call parser", tool_flag, detect_tool_parser),
        ("reasoning parser", reasoning_flag, detect_reasoning_parser),
    ):
        if flag is not None:
            name = None if flag == NONE else flag
            parts.append(f"{kind}: {name or 'none'} (flag)")
        else:
            name, because = detect(template)
            parts.append(f"{kind}: {name or 'none'} (detected: {because})")
        chosen.append(name)
    return ParserChoice(chosen[0], chosen[1], "; ".join(parts))
