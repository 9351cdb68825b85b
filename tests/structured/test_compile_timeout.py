"""What --grammar-compile-timeout times: a spec's own compile, not the one-off build of the grammar engine's
vocabulary; and a server-made tool-call grammar past the limit is kept for the next request (agents send
the same tools every turn), while a client's spec past it is dropped."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from metalserve.engine.async_engine import AsyncEngine
from metalserve.structured import compiler as compiler_module
from metalserve.structured.compiler import GrammarCompiler, GrammarError
from metalserve.structured.limits import GrammarLimits
from metalserve.structured.params import StructuredOutputsParams as S
from tests.api.fakes import tiny_tokenizer

TOK = tiny_tokenizer()
SPEC = S(regex="[0-9]{1,3}")


class _NoCore:
    """check_structured never reaches the core."""


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    limits = GrammarLimits(grammar_compile_timeout=0.3)
    engine = AsyncEngine(
        _NoCore(),  # type: ignore[arg-type]
        TOK,
        model_name="tiny",
        max_model_len=64,
        eos_token_ids={2},
        grammar_limits=limits,
    )
    yield engine
    engine.grammar.shutdown()


def test_the_vocabulary_build_is_not_charged_to_the_first_spec(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = compiler_module.from_tokenizer

    def slow(tokenizer: Any) -> Any:  # a 150k vocabulary on a busy CPU: far past the limit
        time.sleep(1.0)
        return real(tokenizer)

    monkeypatch.setattr(compiler_module, "from_tokenizer", slow)
    asyncio.run(engine.check_structured(SPEC))  # 1 s of vocabulary, then a fast compile: no timeout
    assert engine.grammar.num_compiles == 1


def _slow_compiles(monkeypatch: pytest.MonkeyPatch, release: threading.Event) -> None:
    real = GrammarCompiler._compile

    def slow(self: GrammarCompiler, params: S) -> Any:
        release.wait(10)
        return real(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)


def test_a_tool_grammar_past_the_limit_is_kept_for_the_next_request(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    _slow_compiles(monkeypatch, release)
    with pytest.raises(GrammarError, match="did not compile within"):
        asyncio.run(engine.check_structured(SPEC, keep_on_timeout=True))
    release.set()  # it finishes in the background...
    asyncio.run(engine.check_structured(SPEC, keep_on_timeout=True))  # ...and the next request finds it
    assert engine.grammar.num_compiles == 1


def test_a_clients_spec_past_the_limit_is_dropped(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    _slow_compiles(monkeypatch, release)
    with pytest.raises(GrammarError, match="did not compile within"):
        asyncio.run(engine.check_structured(SPEC))
    release.set()
    asyncio.run(engine.check_structured(SPEC))
    assert engine.grammar.num_compiles == 2  # compiled again: a spec that ran past the limit is not kept
