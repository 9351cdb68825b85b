"""Grammar specs -> llguidance matchers, compiled off the engine thread and cached by spec.

A compiled grammar is kept as a prototype matcher in an LRU keyed by the spec's canonical text; each
request gets a `deep_copy` of it. The cache holds futures, so concurrent requests with one spec share
a single compile, and a failed compile is dropped from the cache (its error is the request's 400).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.hf import from_tokenizer

from metalserve.structured.params import StructuredOutputsParams
from metalserve.structured.state import CompiledGrammar, GrammarState

if TYPE_CHECKING:  # the options type exists only in llguidance's stubs
    from llguidance._lib import JsonCompileOptions

DEFAULT_CACHE_SIZE = 256
# Fixed separators and no free whitespace: a small model left free to emit whitespace inside JSON tends
# to loop on newlines until max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                               "key_separator": ": "}  # fmt: skip
_FIELD_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
                "grammar": "grammar", "structural_tag": "structural tag"}  # fmt: skip


class GrammarError(ValueError):
    """The spec does not compile; the message names the spec kind and llguidance's reason."""

    def __init__(self, kind: str, reason: str) -> None:
        self.kind = kind
        super().__init__(f"invalid {_FIELD_NAMES.get(kind, kind)}: {reason.strip()}")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar definition of one spec (not yet checked against a tokenizer)."""
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(params.choice or ())))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", params.grammar or "")  # Lark or GBNF
        return _structural_tag_grammar(params.structural_tag or "")
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise GrammarError(kind, str(exc) or type(exc).__name__) from None


def _structural_tag_grammar(text: str) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError("a structural tag must be a JSON object with structures and triggers")
    triggers = spec.get("triggers") or []
    tags = []
    for item in spec.get("structures") or []:
        begin = item["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger in {triggers} starts the structure beginning {begin!r}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=item["schema"], end=item["end"]))
    if not tags:
        raise ValueError("the structural tag has no structures")
    return llguidance.StructTag.to_grammar(tags)


class GrammarCompiler:
    """Compiles specs on its own thread for one tokenizer; `submit` never blocks the caller."""

    def __init__(self, tokenizer: Any, *, cache_size: int = DEFAULT_CACHE_SIZE, max_workers: int = 1) -> None:
        self._hf_tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="metalserve-grammar")
        self.num_compiles = 0  # grammars actually built (cache misses), for tests and stats

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about a second for a large vocabulary), on the compile thread."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = from_tokenizer(self._hf_tokenizer)
        return self._ll_tokenizer

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The prototype matcher of the spec, compiled in the background (or found in the cache)."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._drop_failed(key, f))
        return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking form of `submit` (raises GrammarError)."""
        return self.submit(params).result()

    def _drop_failed(self, key: str, future: Future[CompiledGrammar]) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        text = grammar_text(params)
        tokenizer = self.ll_tokenizer
        try:
            matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        except Exception as exc:  # llguidance reports grammar errors on the matcher, but be sure: a 400
            raise GrammarError(params.kind, str(exc) or type(exc).__name__) from None
        self.num_compiles += 1
        if matcher.is_error():
            raise GrammarError(params.kind, matcher.get_error())
        return CompiledGrammar(matcher, tokenizer.vocab_size)

    def make_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A new request's grammar state; it becomes ready when the compile finishes."""
        return GrammarState(self.submit(params), params.reasoning_end_token_ids)

    def __len__(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
