"""The compile cache: one compile per spec, LRU eviction, errors that name the spec and are not cached."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from metalserve.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarError
from metalserve.structured.params import StructuredOutputsParams as S
from tests.api.fakes import tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_params_need_exactly_one_spec() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="got json, regex"):
        S(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="non-empty"):
        S(choice=())
    assert S(choice=["a", "b"]).choice == ("a", "b")  # type: ignore[arg-type]


def test_cache_key_is_canonical() -> None:
    assert (
        S(json=SCHEMA).cache_key()
        == S(json='{"required": ["a"], "type": "object", "properties": {"a": {"type": "integer"}}}').cache_key()
    )
    assert S(json=SCHEMA).cache_key() != S(json={"type": "object"}).cache_key()
    # The reasoning gate is per request, not part of the compiled grammar.
    assert S(regex="a+", reasoning_end_token_ids=(5,)).cache_key() == S(regex="a+").cache_key()


def test_equal_specs_compile_once_and_share_the_future() -> None:
    compiler = GrammarCompiler(tiny_tokenizer())
    first = compiler.submit(S(json=SCHEMA))
    second = compiler.submit(S(json=dict(SCHEMA)))
    assert first is second
    assert isinstance(first.result(), CompiledGrammar)
    compiler.compile(S(json=SCHEMA))
    assert compiler.num_compiles == 1
    compiler.compile(S(regex="[0-9]+"))
    assert compiler.num_compiles == 2


def test_lru_evicts_the_least_recently_used() -> None:
    compiler = GrammarCompiler(tiny_tokenizer(), cache_size=2)
    compiler.compile(S(regex="a"))
    compiler.compile(S(regex="b"))
    compiler.compile(S(regex="a"))  # a is now the most recent
    compiler.compile(S(regex="c"))  # evicts b
    assert len(compiler) == 2 and compiler.num_compiles == 3
    compiler.compile(S(regex="a"))
    assert compiler.num_compiles == 3
    compiler.compile(S(regex="b"))
    assert compiler.num_compiles == 4


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (S(json={"type": "objec"}), "invalid JSON schema"),
        (S(json="{not json"), "invalid JSON schema"),
        (S(json="[1, 2]"), "invalid JSON schema"),
        (S(regex="[0-9"), "invalid regex"),
        (S(grammar="start: foo"), "invalid grammar"),
        (
            S(structural_tag='{"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]}'),
            "invalid structural tag",
        ),
    ],
)
def test_invalid_specs_raise_grammar_error_and_are_not_cached(spec: S, words: str) -> None:
    compiler = GrammarCompiler(tiny_tokenizer())
    with pytest.raises(GrammarError, match=words):
        compiler.compile(spec)
    assert len(compiler) == 0


def test_grammar_kinds_compile() -> None:
    compiler = GrammarCompiler(tiny_tokenizer())
    tag = '{"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]}'
    for spec in [
        S(json_object=True),
        S(choice=("x", "y")),
        S(grammar='root ::= "yes" | "no"'),
        S(grammar='start: "a" | "b"'),
        S(structural_tag=tag),
    ]:
        assert not compiler.compile(spec).matcher.is_error()


def test_compiles_off_the_calling_thread() -> None:
    compiler = GrammarCompiler(tiny_tokenizer())
    seen: list[str] = []
    original = compiler._compile

    def spy(params: S) -> CompiledGrammar:
        seen.append(threading.current_thread().name)
        return original(params)

    compiler._compile = spy  # type: ignore[method-assign]
    future: Future[CompiledGrammar] = compiler.submit(S(regex="q+"))
    future.result()
    assert seen and seen[0].startswith("metalserve-grammar")


def test_the_cache_is_bounded_in_bytes_as_well_as_entries() -> None:
    from metalserve.structured.limits import GrammarLimits

    compiler = GrammarCompiler(tiny_tokenizer(), limits=GrammarLimits(cache_size=100, grammar_cache_bytes=3000))
    specs = [S(choice=tuple(f"{i}-{j:03d}" for j in range(40))) for i in range(12)]
    for spec in specs:
        compiler.compile(spec)
        assert compiler.cache_bytes <= 3000
    assert 1 < len(compiler) < len(specs)
    assert compiler.cache_bytes == sum(compiler._sizes.values())
    before = compiler.num_compiles
    compiler.compile(specs[-1])  # the newest is still cached
    assert compiler.num_compiles == before
    compiler.compile(specs[0])  # the oldest was evicted for room
    assert compiler.num_compiles == before + 1


def test_a_spec_over_the_size_limit_is_refused_without_compiling() -> None:
    from metalserve.structured.limits import GrammarLimits

    compiler = GrammarCompiler(tiny_tokenizer(), limits=GrammarLimits(max_grammar_bytes=100))
    with pytest.raises(GrammarError, match="limit .* is 100"):
        compiler.compile(S(regex="a" * 200))
    assert compiler.num_compiles == 0 and len(compiler) == 0 and compiler.cache_bytes == 0


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (S(regex="a{1000000}"), "too complex"),
        (S(grammar='start: a\na: a "x"'), "matches no text"),
        (S(json={"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}), "matches no text"),
    ],
)
def test_grammars_that_cannot_produce_text_are_refused(spec: S, words: str) -> None:
    compiler = GrammarCompiler(tiny_tokenizer())
    with pytest.raises(GrammarError, match=words) as info:
        compiler.compile(spec)
    assert "\n" not in str(info.value) and len(compiler) == 0 and compiler.cache_bytes == 0


def test_building_the_vocabulary_view_hands_its_freed_heap_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar engine's tokenizer is built once; the copy of the vocabulary it went through goes back
    to the system then (platform.return_freed_memory), not on later uses."""
    from metalserve.structured import compiler as compiler_module

    calls: list[int] = []
    monkeypatch.setattr(compiler_module, "return_freed_memory", lambda: calls.append(1))
    compiler = GrammarCompiler(tiny_tokenizer())
    first = compiler.tokenizer_ready().result(timeout=60)
    assert compiler.ll_tokenizer is first and calls == [1]
