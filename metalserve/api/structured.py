"""The API side of structured outputs: request fields -> one grammar spec, compiled before admission.

Chat takes `response_format` (json_object, json_schema), `structured_outputs` (vLLM's field) or a forced
`tool_choice`; completions take `structured_outputs`. At most one of them may constrain a request.
Compiling here (on the grammar thread, awaited) turns a bad schema, regex or grammar into a 400 that
names it before the engine ever sees the request; the engine then finds the grammar in the cache.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from metalserve.api.errors import OpenAIError
from metalserve.api.protocol import StructuredOutputsRequest
from metalserve.api.serving_context import ServingContext
from metalserve.api.tool_choice import ToolChoiceError, forced_tool_params
from metalserve.api.tool_parsers import ToolParser
from metalserve.structured.compiler import GrammarError
from metalserve.structured.params import StructuredOutputsParams
from metalserve.structured.schema import strict_schema

logger = logging.getLogger(__name__)


def from_structured_outputs(field: StructuredOutputsRequest) -> StructuredOutputsParams:
    """vLLM's `structured_outputs` object as params; exactly one constraint, else a 400."""
    tag = field.structural_tag
    try:
        return StructuredOutputsParams(
            json=field.json_,
            json_object=bool(field.json_object),
            regex=field.regex,
            choice=tuple(field.choice) if field.choice is not None else None,
            grammar=field.grammar,
            structural_tag=json.dumps(tag) if isinstance(tag, dict) else tag,
        )
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="structured_outputs") from None


def from_response_format(response_format: Any) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: text -> None, json_object, json_schema ({"name", "schema", "strict"})."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = response_format.json_schema["schema"]
    if response_format.json_schema.get("strict") is True:
        schema = strict_schema(schema)
    return StructuredOutputsParams(json=schema)


def chat_structured(req: Any) -> tuple[StructuredOutputsParams | None, str]:
    """The one constraint of a chat request and the field it came from ("" when none)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fmt = from_response_format(req.response_format)
    if fmt is not None:
        found.append((fmt, "response_format"))
    if req.structured_outputs is not None:
        found.append((from_structured_outputs(req.structured_outputs), "structured_outputs"))
    try:
        forced = forced_tool_params(req.tools, req.tool_choice)
    except ToolChoiceError as exc:
        raise OpenAIError(str(exc), 400, param="tool_choice") from None
    if forced is not None:
        found.append((forced, "tool_choice"))
    if len(found) > 1:
        names = " and ".join(name for _, name in found)
        raise OpenAIError(f"{names} each constrain the output; give only one of them", 400, param=found[1][1])
    return found[0] if found else (None, "")


def completion_structured(req: Any) -> tuple[StructuredOutputsParams | None, str]:
    if req.structured_outputs is None:
        return None, ""
    return from_structured_outputs(req.structured_outputs), "structured_outputs"


async def check_compiles(ctx: ServingContext, params: StructuredOutputsParams | None, param: str) -> None:
    """Compile the grammar now; an invalid schema, regex or grammar is a 400 naming the field."""
    if params is None:
        return
    try:
        await ctx.engine.check_structured(params)
    except GrammarError as exc:
        field = param if param != "structured_outputs" else f"structured_outputs.{params.kind}"
        raise OpenAIError(f"{field}: {exc}", 400, param=field) from None


async def auto_tool_params(
    ctx: ServingContext, parser: ToolParser, req: Any, special_tokens: frozenset[str]
) -> StructuredOutputsParams | None:
    """The lazy tool-call grammar of a `tool_choice: auto` request (text free, calls valid), compiled;
    None when its parser has none or it does not compile (the request then runs unconstrained: a tool
    schema the grammar engine refuses is no reason to refuse the request)."""
    if not req.tools:
        return None
    text = parser.call_grammar(req.tools, parallel=req.parallel_tool_calls is not False, special_tokens=special_tokens)
    if text is None:
        return None
    params = StructuredOutputsParams(grammar=text)
    try:
        # A compile past the limit goes on in the background: agents send the same tools every turn,
        # so the next request finds it in the cache.
        await ctx.engine.check_structured(params, keep_on_timeout=True)
    except GrammarError as exc:
        logger.warning("tool calls of this request are not constrained: %s", exc)
        return None
    return params
