"""Calls that are always valid under `tool_choice: auto`: llama.cpp's lazy grammar, in llguidance's Lark.

Text is free until the model writes the opening of a call of a declared tool in a form the Hermes
parser reads (hermes.py): an optional fence, then `{"name": "NAME`; or `<function=NAME>` /
`<function name="NAME">`; or a call tag (`<tool_call>`, `<tools>`, ...) then `{"name": "`, after which
the name too is held to the declared tools. Each opening is a lazy lexeme (`rule[lazy]: TEXT /.../`):
it ends at the first place the text matches it, so prose before it stays free. From there on the
output is that tool's call: the name's closing quote, `, "arguments": `, an object valid for the tool's
JSON schema, `}`, and a closing. After the call the output ends or (parallel calls) goes on with
another call right away.

One lexeme per tool and form keeps llguidance's lexer small (a lexeme per tool, tag and fence blew
its expression limit at 20 tools), so a text tag's closing is not tied to its opening: any tag closing
and fence closing may follow, or none. The model closes what it opened; the parser reads a call
whatever closing follows it. A tag that the tokenizer holds as one added token (Qwen's `<tool_call>`)
is not text to the grammar engine: it is named as a token, opens a call by itself and is closed by its
own closing token.
"""

from __future__ import annotations

import json
from typing import Any

from metalserve.api.tool_parsers.argument_grammar import argument_rules

# The tags llama.cpp's Hermes 2 Pro parser accepts before a call object, and the fences' languages
# (the parser, hermes.py, reads the same forms).
CALL_TAGS = ("tool_call", "function_call", "tool", "tools", "response", "json", "xml", "JSON")
FENCE_LANGS = ("json", "xml")

# The arguments may be laid out as the model likes (these models pretty-print JSON), but whitespace is
# bounded: free whitespace lets a small model loop on newlines, and none at all (structured outputs'
# default) made the 0.5B model, denied the newline it wanted after a number, write digits until
# max_tokens. Keywords the grammar engine cannot enforce are left out (lenient) rather than refusing the
# tool: a tool's schema is the client's, and often a large one.
ARGUMENT_OPTIONS: dict[str, Any] = {"whitespace_pattern": r"[ \t\n]{0,16}", "lenient": True}
_SPACE = r"[ \t\n]*"
# Whitespace where the grammar already constrains the output is bounded: a small model left free to
# write whitespace there tends to loop on newlines until max_tokens.
_GAP = r"[ \t\n]{0,8}"
_FENCE = r"(```(" + "|".join(FENCE_LANGS) + r")?\n" + _SPACE + ")"


def hermes_call_grammar(
    tools: dict[str, dict[str, Any]], *, parallel: bool = True, special_tokens: frozenset[str] = frozenset()
) -> str:
    """The lazy Lark grammar of calls of `tools` (name -> parameters schema). `special_tokens`: the
    tokenizer's added tokens (only the call tags among them matter)."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    text_tags = [t for t in CALL_TAGS if f"<{t}>" not in special_tokens]
    token_tags = [t for t in CALL_TAGS if f"<{t}>" in special_tokens and f"</{t}>" in special_tokens]
    opening = f"{_FENCE}?(<({'|'.join(text_tags)})>{_SPACE})?"
    # A call tag then `{"name": "` is a call whatever name follows: from there the name is held to the
    # declared ones (as the `<tool_call>` token is), so a small model that writes `<tools>` and a tool it
    # made up is steered to a real one. A fence or a bare object opens a call only with a declared name.
    tagged = rf'{_FENCE}?<({"|".join(text_tags)})>{_SPACE}\{{{_GAP}"name"{_GAP}:{_GAP}"'
    lines = [
        "%llguidance {}",
        r"TEXT: /(.|\n)*/",
        f"GAP: /{_GAP}/",
        rf'ARGS_KEY: /{_GAP},{_GAP}"(arguments|parameters)"{_GAP}:{_GAP}/',
        rf"CLOSE_TAG: /\n?<\/({'|'.join(text_tags)})>/",
        r"CLOSE_FENCE: /\n?```/",
        "closing: CLOSE_TAG? " + ("close_token? " if token_tags else "") + "CLOSE_FENCE?",
    ]
    if token_tags:
        lines.append("close_token: " + " | ".join(f"GAP </{t}>" for t in token_tags))
    first, more, named = [], [], []
    for i, (name, schema) in enumerate(tools.items()):
        # The opening ends with the name, not its closing quote, so a name the model would go on past
        # ("run_shell.py") is held to the tool's; unless it is the start of another tool's name.
        quote_in_head = any(other != name and other.startswith(name) for other in tools)
        quote = "" if quote_in_head else '"\\""'
        spelled = json.dumps(name) if quote_in_head else json.dumps(name)[:-1]
        head = rf'\{{{_GAP}"name"{_GAP}:{_GAP}{_regex_literal(spelled)}'
        function = rf'<function(={_regex_literal(name)}>| name="{_regex_literal(name)}">){_SPACE}'
        lines += [
            *argument_rules(i, schema, ARGUMENT_OPTIONS),
            rf'json_call_{i}: {quote} ARGS_KEY args_{i} GAP "}}"',
            f"json_rest_{i}: json_call_{i} closing",
            rf"function_rest_{i}: args_{i} /\n?<\/function>/",
            f"json_lazy_{i}[lazy]: TEXT /{_FENCE}?{head}/",  # a tag first: tagged_lazy
            f"function_lazy_{i}[lazy]: TEXT /{function}/",
            f"JSON_NOW_{i}: /{_GAP}{opening}{head}/",
            f"HEAD_{i}: /{head}/",
            f"NAME_{i}: /{_regex_literal(spelled[1:])}/",
        ]
        named.append(f"NAME_{i} json_rest_{i}")
        first += [f"json_lazy_{i} json_rest_{i}", f"function_lazy_{i} function_rest_{i}"]
        more.append(f"JSON_NOW_{i} json_rest_{i}")
        for tag in token_tags:  # written as its one token: free text, the token, the call, its closing
            close = f"GAP </{tag}> CLOSE_FENCE?"
            first.append(f"TEXT <{tag}> GAP HEAD_{i} json_call_{i} {close}")
            more.append(f"GAP <{tag}> GAP HEAD_{i} json_call_{i} {close}")
    lines.append(f"tagged_lazy[lazy]: TEXT /{tagged}/")
    first.append("tagged_lazy tagged_call")
    lines.append("tagged_call: " + " | ".join(named))
    lines.append("first_call: " + " | ".join(first))
    lines.append("next_call: " + " | ".join(more))
    lines.append("start: TEXT | first_call" + (" next_call*" if parallel else ""))
    return "\n".join(lines) + "\n"


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/ (slashes escaped too)."""
    out = []
    for ch in text:
        if ch.isalnum() or ch in "_- ":
            out.append(ch)
        elif ch == "/":
            out.append("\\/")
        elif ch == "\n":
            out.append("\\n")
        else:
            out.append("\\" + ch if ch.isascii() else ch)
    return "".join(out)
