"""The lazy tool-call grammar in the engine (tiny random-weight model): every call it starts is valid for
its schema, and the tokens are the same with speculative decoding and with async scheduling.

The random model is nudged towards `<tool_call>` (an added token, as in Qwen's vocabulary) by a logit
bias, so it opens calls at random places; from that token on, the grammar makes the call valid."""

from __future__ import annotations

import json

import jsonschema
import pytest

from metalserve.api.tool_parsers import get_tool_parser
from metalserve.api.tool_parsers.hermes_grammar import hermes_call_grammar
from metalserve.engine.core import EngineCore
from metalserve.request import Request
from metalserve.speculative_config import SpeculativeConfig
from metalserve.structured.compiler import GrammarCompiler
from metalserve.structured.params import StructuredOutputsParams
from tests.structured.test_engine import SCHEMA, TOK, make_core, request, run

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
CALL_TOKEN = TOK.convert_tokens_to_ids("<tool_call>")
# The random model is pushed to open calls and kept from spending its tokens on the whitespace that the
# grammar allows (bounded) between JSON tokens.
BIAS = {CALL_TOKEN: 10.0} | {
    t: -8.0 for t, piece in enumerate(TOK.convert_ids_to_tokens(list(range(len(TOK))))) if not piece.strip("ĠĊĉ")
}
SPEC = StructuredOutputsParams(
    grammar=hermes_call_grammar(
        {"get_weather": SCHEMA}, parallel=False, special_tokens=frozenset(TOK.get_added_vocab())
    )
)


def requests(compiler: GrammarCompiler) -> list[Request]:
    out = []
    for i in range(8):
        greedy = {"temperature": 0.0} if i < 2 else {"seed": i}
        out.append(request(f"t{i}", compiler, SPEC, max_tokens=80, logit_bias=BIAS, **greedy))
    return out


@pytest.mark.parametrize("variant", ["speculative", "async"])
def test_calls_are_valid_and_identical_with_speculation_and_async_scheduling(variant: str) -> None:
    compiler = GrammarCompiler(TOK)
    base: EngineCore = make_core()
    other: EngineCore = (
        make_core(speculative_config=NGRAM) if variant == "speculative" else make_core(async_scheduling=True)
    )
    assert variant != "async" or other.async_scheduling
    tokens, reasons, _ = run(base, requests(compiler))
    tokens_other, reasons_other, _ = run(other, requests(compiler))
    assert tokens_other == tokens and reasons_other == reasons
    parser = get_tool_parser("hermes").for_request(TOOLS)
    calls = 0
    for ids in tokens.values():
        parsed = parser.extract(TOK.decode(ids, skip_special_tokens=False))
        for call in parsed.calls:
            assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), SCHEMA)
        calls += len(parsed.calls)
    assert calls >= 4  # the bias made at least half of them call; each call the grammar let through is valid
