"""The engine with a tiny random-weight model: every output follows its grammar, in one mixed batch."""

from __future__ import annotations

import asyncio
import json
import math
import re
from concurrent.futures import Future

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from metalserve.config import EngineConfig
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.core import EngineCore
from metalserve.engine.engine_thread import EngineThread
from metalserve.executor.sampler import Sampler
from metalserve.outputs import TokenLogprob
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from metalserve.structured.compiler import CompiledGrammar, GrammarCompiler
from metalserve.structured.params import StructuredOutputsParams as S
from metalserve.structured.state import GrammarState
from tests.api.fakes import tiny_tokenizer
from tests.engine.test_core import tiny_loaded
from tests.executor.tiny_models import tiny_model

TOK = tiny_tokenizer()
EOS = frozenset({2})
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Berlin"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "n", "ok"],
    "additionalProperties": False,
}
PROMPT = list(TOK.encode("The capital of France", add_special_tokens=False))


def make_core(**config: object) -> EngineCore:
    loaded = tiny_loaded()
    loaded.model = tiny_model("llama", vocab_size=len(TOK))
    loaded.eos_token_ids = EOS
    defaults: dict[str, object] = {"kv_cache_memory": 1 << 22, "max_num_batched_tokens": 64, "block_size": 8}
    return build_engine_core(EngineConfig(**{**defaults, **config}), loaded)  # type: ignore[arg-type]


def request(rid: str, compiler: GrammarCompiler, spec: S | None, **params: object) -> Request:
    sp = SamplingParams(**{"temperature": 1.0, "max_tokens": 48, "structured_outputs": spec, **params})  # type: ignore[arg-type]
    r = Request(rid, PROMPT, sp, eos_token_ids=EOS)
    if spec is not None:
        r.structured = compiler.make_state(spec)
    return r


Outcome = tuple[dict[str, list[int]], dict[str, str], dict[str, list[TokenLogprob]]]


def run(core: EngineCore, requests: list[Request]) -> Outcome:
    for r in requests:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str] = {}
    logprobs: dict[str, list[TokenLogprob]] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs or []
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
    return tokens, reasons, logprobs


def text(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def test_a_mixed_batch_follows_each_grammar() -> None:
    compiler = GrammarCompiler(TOK)
    specs = {
        "json": S(json=SCHEMA),
        "regex": S(regex=r"[0-9]{2,4}-(yes|no)"),
        "choice": S(choice=("Paris", "Berlin")),
        "free": None,
    }
    reqs = [request(f"{k}{i}", compiler, spec, seed=i) for i in range(2) for k, spec in specs.items()]
    tokens, reasons, _ = run(make_core(), reqs)
    for i in range(2):  # n > 1: each sample has its own matcher
        jsonschema.validate(json.loads(text(tokens[f"json{i}"])), SCHEMA)
        assert re.fullmatch(r"[0-9]{2,4}-(yes|no)", text(tokens[f"regex{i}"]))
        assert text(tokens[f"choice{i}"]) in ("Paris", "Berlin")
        assert all(reasons[f"{k}{i}"] == "stop" for k in ("json", "regex", "choice"))
    # Unconstrained, the random model writes anything at all: the grammar is what made the others valid.
    assert not re.fullmatch(r"[0-9]{2,4}-(yes|no)", text(tokens["free0"]))


def test_logprobs_are_of_the_masked_distribution() -> None:
    compiler = GrammarCompiler(TOK)
    r = request("c", compiler, S(choice=("Paris", "Berlin")), logprobs=20, temperature=0.0)
    tokens, _, logprobs = run(make_core(), [r])
    first = logprobs["c"][0]
    finite = [(t, lp) for t, lp in first.top if math.isfinite(lp)]
    assert {TOK.decode([t]) for t, _ in finite} <= {
        "P",
        "Pa",
        "Par",
        "Pari",
        "Paris",
        "B",
        "Be",
        "Ber",
        "Berl",
        "Berli",
        "Berlin",
    }
    assert len(finite) < len(first.top)  # everything else was masked to -inf
    assert math.isclose(sum(math.exp(lp) for _, lp in finite), 1.0, rel_tol=1e-4)
    assert first.token_id == tokens["c"][0] and first.logprob == max(lp for _, lp in finite)


def test_preemption_by_recompute_keeps_the_matcher_right() -> None:
    compiler = GrammarCompiler(TOK)
    spec = S(json=SCHEMA)
    calm = run(make_core(), [request("a", compiler, spec, temperature=0.0)])[0]["a"]
    per_block = 2 * 2 * 2 * 16 * 4 * 8
    tight = make_core(kv_cache_memory=9 * per_block, max_model_len=64, max_num_batched_tokens=32)
    reqs = [request(f"r{i}", compiler, spec, temperature=0.0) for i in range(4)]
    tokens, _, _ = run(tight, reqs)
    assert tight.make_stats().num_preemptions > 0
    assert all(tokens[f"r{i}"] == calm for i in range(4))
    jsonschema.validate(json.loads(text(calm)), SCHEMA)


def test_a_request_waits_for_its_compile_while_others_run() -> None:
    core = make_core()
    pending: Future[CompiledGrammar] = Future()
    waiting = request("w", GrammarCompiler(TOK), None, temperature=0.0, max_tokens=8)
    waiting.structured = GrammarState(pending)
    core.add_request(waiting)
    core.add_request(request("free", GrammarCompiler(TOK), None, temperature=0.0, max_tokens=4, ignore_eos=True))
    done: list[str] = []
    for _ in range(10):
        done += [o.request_id for o in core.step() if o.finish_reason]
    assert done == ["free"] and waiting.num_computed_tokens == 0
    pending.set_result(GrammarCompiler(TOK).compile(S(choice=("Berlin",))))
    while core.has_unfinished_requests():
        done += [o.request_id for o in core.step() if o.finish_reason]
    assert done == ["free", "w"] and text(waiting.output_token_ids) == "Berlin"


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_both_sampler_backends_mask(backend: str) -> None:
    compiler = GrammarCompiler(TOK)
    states = [compiler.make_state(S(regex="[0-9]+")) for _ in range(2)]
    compiler.compile(S(regex="[0-9]+"))
    assert all(s.is_ready() for s in states)

    class Row:
        sampling_params = SamplingParams(temperature=0.0)
        prompt_token_ids = PROMPT
        output_token_ids: list[int] = []
        num_output_tokens = 0
        eos_token_ids = EOS

        def __init__(self, state: GrammarState | None) -> None:
            self.structured = state

    rows = [Row(states[0]), Row(None), Row(states[1])]
    logits = mx.array(np.random.default_rng(0).normal(size=(3, len(TOK))).astype(np.float32))
    got = Sampler(0, backend)(logits, rows).token_ids
    assert all(TOK.decode([got[i]]).isdigit() for i in (0, 2))
    assert got[1] == int(np.argmax(np.array(logits[1])))


def test_stop_strings_and_streaming_through_the_async_engine() -> None:
    thread = EngineThread()  # as the server does: the core is built on the thread that steps it
    core = thread.call(make_core)
    engine = AsyncEngine(core, TOK, model_name="tiny", max_model_len=256, eos_token_ids=EOS, thread=thread)
    spec = S(choice=("Hello world! The end.",))

    async def go() -> tuple[list[str], str | None]:
        await engine.check_structured(spec)
        params = SamplingParams(temperature=0.0, max_tokens=32, stop=["The"], structured_outputs=spec)
        pieces, reason = [], None
        async for out in engine.generate(PROMPT, params, "s"):
            pieces.append(out.text)
            reason = out.finish_reason
        await engine.shutdown()
        return pieces, reason

    pieces, reason = asyncio.run(go())
    assert "".join(pieces) == "Hello world! " and reason == "stop" and len(pieces) > 1


def test_the_grammar_starts_after_the_reasoning_end_marker() -> None:
    compiler = GrammarCompiler(TOK)
    free = run(make_core(), [request("f", compiler, None, temperature=0.0, max_tokens=3, ignore_eos=True)])[0]["f"]
    marker = tuple(free[:2])  # what this model writes first, greedily: a stand-in for `</think>`
    spec = S(choice=("Paris",), reasoning_end_token_ids=marker)
    tokens, reasons, _ = run(make_core(), [request("g", compiler, spec, temperature=0.0)])
    assert tuple(tokens["g"][:2]) == marker  # unconstrained until the marker is out
    assert text(tokens["g"][2:]) == "Paris" and reasons["g"] == "stop"
