"""Matchers: advance with each token, end on grammar completion, the reasoning gate, replay, batched masks."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from metalserve.structured.bitmask import BatchMasker
from metalserve.structured.compiler import CompiledGrammar, GrammarCompiler
from metalserve.structured.params import StructuredOutputsParams as S
from metalserve.structured.state import GrammarState
from tests.api.fakes import tiny_tokenizer

TOK = tiny_tokenizer()
COMPILER = GrammarCompiler(TOK)


def ids(text: str) -> list[int]:
    return list(TOK.encode(text, add_special_tokens=False))


def ready(spec: S) -> GrammarState:
    state = COMPILER.make_state(spec)
    COMPILER.submit(spec).result()
    assert state.is_ready() and state.error is None
    return state


def allowed_ids(state: GrammarState) -> set[int]:
    mask = BatchMasker().allowed([state], state.vocab_size, len(TOK))
    return set(np.flatnonzero(mask[0]).tolist())


def test_waits_for_its_compile() -> None:
    pending: Future[CompiledGrammar] = Future()
    state = GrammarState(pending)
    assert not state.is_ready()
    pending.set_result(COMPILER.compile(S(regex="a")))
    assert state.is_ready() and state.constrains_next


def test_a_failed_compile_is_ready_with_an_error() -> None:
    failed: Future[CompiledGrammar] = Future()
    failed.set_exception(ValueError("bad"))
    state = GrammarState(failed)
    assert state.is_ready() and state.error == "bad" and not state.constrains_next


def test_accept_advances_and_completion_ends() -> None:
    state = ready(S(choice=("Paris", "Berlin")))
    tokens = ids("Paris")
    assert set(tokens[:1]) <= allowed_ids(state)
    assert all(not state.accept(t) for t in tokens[:-1])
    assert state.accept(tokens[-1])  # "Paris" completes the grammar: the request must end
    assert state.terminated and state.num_seen == len(tokens)


def test_a_refused_token_ends_with_an_error() -> None:
    state = ready(S(regex="[0-9]+"))
    assert state.accept(ids("Hello")[0])
    assert state.error


def test_each_state_has_its_own_matcher() -> None:
    a, b = ready(S(regex="(ab|cd)e")), ready(S(regex="(ab|cd)e"))
    a.accept(ids("a")[0])
    assert a.matcher is not b.matcher
    assert ids("c")[0] in allowed_ids(b) and ids("c")[0] not in allowed_ids(a)


def test_reasoning_gate_defers_the_grammar_until_the_marker() -> None:
    marker = ids("STOP now")  # a fake reasoning-end marker of two or more tokens
    assert len(marker) >= 2
    state = ready(S(choice=("yes",), reasoning_end_token_ids=tuple(marker)))
    assert not state.constrains_next
    for t in ids("The end. ") + marker[:-1]:
        assert not state.accept(t)
        assert not state.constrains_next  # free text: nothing is masked yet
    state.accept(marker[-1])
    assert state.constrains_next
    allowed = allowed_ids(state)
    assert allowed and all("yes".startswith(TOK.decode([t])) and TOK.decode([t]) for t in allowed)
    done = [state.accept(t) for t in ids("yes")]
    assert done[-1] and not any(done[:-1])


def test_replay_rebuilds_the_same_state() -> None:
    spec = S(json={"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    text = ids('{"name": "Paris')
    advanced = ready(spec)
    for t in text + ids('", "x'):  # went further than the output now stands (it was rolled back)
        advanced.accept(t)
    advanced.replay(text)
    fresh = ready(spec)
    for t in text:
        fresh.accept(t)
    assert advanced.num_seen == len(text) and not advanced.terminated
    assert allowed_ids(advanced) == allowed_ids(fresh)


def test_batched_fill_equals_one_by_one() -> None:
    specs = [S(regex="[0-9]+"), S(choice=("Paris", "Berlin")), S(json_object=True), S(regex="[a-z]{3}")] * 3
    states = [ready(s) for s in specs]
    states[2].accept(ids("{")[0])
    batched = BatchMasker(num_threads=2).allowed(states, states[0].vocab_size, len(TOK) + 7)
    assert batched.shape == (len(states), len(TOK) + 7)
    assert not batched[:, len(TOK) :].any()  # ids past the tokenizer (padded logits) are never allowed
    for row, state in enumerate(states):
        assert set(np.flatnonzero(batched[row]).tolist()) == allowed_ids(state)


def test_eos_is_allowed_only_where_the_grammar_may_end() -> None:
    eos = TOK.eos_token_id
    state = ready(S(regex="[0-9]+"))
    assert eos not in allowed_ids(state)  # an empty output does not match
    state.accept(ids("7")[0])
    assert eos in allowed_ids(state)  # "7" matches, and more digits could follow
    assert not state.terminated
