"""Grammar specs -> llguidance matchers, compiled off the engine thread and cached by spec.

A compiled grammar is kept as a prototype matcher in an LRU keyed by the spec's canonical text; each
request gets a `deep_copy` of it. The cache holds futures, so concurrent requests with one spec share
a single compile, and a failed compile is dropped from the cache (its error is the request's 400).
The LRU is bounded in entries and in bytes (the grammar text, as llguidance does not report its own).

A grammar is checked before any request uses it: a spec over `max_grammar_bytes`, a grammar over the
parser's limits, one whose language is empty (nothing matches it) or one too complex for the lexer
to take its first token is a GrammarError with a one-line reason; llguidance's own long messages
(parser dumps, Rust panics with backtraces) go to the log only.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llnp
import numpy as np
from llguidance.hf import from_tokenizer

from metalserve.platform import return_freed_memory
from metalserve.structured.limits import GrammarLimits
from metalserve.structured.params import StructuredOutputsParams
from metalserve.structured.schema import drop_annotation_formats
from metalserve.structured.state import CompiledGrammar, GrammarState

if TYPE_CHECKING:  # the options type exists only in llguidance's stubs
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger("metalserve.structured")

# Fixed separators and no free whitespace: a small model left free to emit whitespace inside JSON tends
# to loop on newlines until max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FIELD_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def _probe(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, kind: str) -> None:
    """Refuse a grammar that no text matches, or whose first token the lexer cannot take (on a copy).

    llguidance finds an empty language only when it computes a mask (NoExtension), and a lexer blow-up
    (`a{1000000}`) only when it consumes a token; before this, both ended a request early with "stop".
    """
    probe = matcher.deep_copy()
    mask = llnp.allocate_token_bitmask(1, tokenizer.vocab_size)
    llnp.fill_next_token_bitmask(probe, mask, 0)
    if probe.is_error():
        raise GrammarError(kind, _probe_reason(probe.get_error()))
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: tokenizer.vocab_size]
    allowed = [int(t) for t in np.flatnonzero(bits)[:2] if t != tokenizer.eos_token]
    if not allowed:
        if not probe.is_accepting():
            raise GrammarError(kind, "the grammar matches no text (its language is empty)")
        return
    if not probe.consume_token(allowed[0]):
        raise GrammarError(kind, _probe_reason(probe.get_error()))


def _probe_reason(error: str) -> str:
    if error.startswith("NoExtension"):
        return "the grammar matches no text (its language is empty)"
    if "lexer" in error or "too many" in error or "TooComplex" in error:
        return f"the grammar is too complex for the grammar engine ({short_reason(error)})"
    return short_reason(error)


class GrammarError(ValueError):
    """The spec does not compile; the message names the spec kind and llguidance's reason."""

    def __init__(self, kind: str, reason: str) -> None:
        self.kind = kind
        super().__init__(f"invalid {_FIELD_NAMES.get(kind, kind)}: {short_reason(reason)}")


def short_reason(message: str) -> str:
    """llguidance's message cut to its first line, without dumps or panics (those are logged, not sent)."""
    first = message.strip().split("\n", 1)[0].strip()
    if first.startswith("panic") or "backtrace" in message[:200]:
        logger.warning("llguidance failed on a grammar: %s", message[:4000])
        return "the grammar is too large or complex for the grammar engine"
    if len(message) > len(first):
        logger.debug("llguidance: %s", message[:4000])
    return first[:300] or "rejected by the grammar engine"


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
            schema = drop_annotation_formats(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex or "")
        if kind == "choice":
            return _choice_grammar(list(params.choice or ()))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", params.grammar or "")  # Lark or GBNF
        return _structural_tag_grammar(params.structural_tag or "")
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise GrammarError(kind, str(exc) or type(exc).__name__) from None


# llguidance caps one alternation at 2,000 items (its own `choice` grammar adds one): longer lists are
# split into rows of this many, each its own rule.
CHOICE_ROW = 1000


def _choice_grammar(choices: list[str]) -> str:
    """A grammar matching exactly one of `choices`, for any number of them (the limit is the spec's bytes)."""
    if len(choices) <= CHOICE_ROW:
        return llguidance.grammar_from("choice", json.dumps(choices))
    rows = [choices[i : i + CHOICE_ROW] for i in range(0, len(choices), CHOICE_ROW)]
    lines = ["start: " + " | ".join(f"ROW{i}" for i in range(len(rows)))]
    lines += [f"ROW{i}: " + " | ".join(json.dumps(c) for c in row) for i, row in enumerate(rows)]
    return llguidance.grammar_from("lark", "\n".join(lines))


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
        schema = drop_annotation_formats(item["schema"])
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=item["end"]))
    if not tags:
        raise ValueError("the structural tag has no structures")
    return llguidance.StructTag.to_grammar(tags)


class GrammarCompiler:
    """Compiles specs on its own thread for one tokenizer; `submit` never blocks the caller."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        cache_size: int | None = None,
        max_workers: int = 1,
        limits: GrammarLimits | None = None,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.limits = limits or GrammarLimits()
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size if cache_size is not None else self.limits.cache_size
        self._sizes: dict[str, int] = {}  # bytes charged per cached grammar
        self.cache_bytes = 0  # their sum
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="metalserve-grammar")
        self._tokenizer_future: Future[llguidance.LLTokenizer] | None = None
        self.num_compiles = 0  # grammars actually built (cache misses), for tests and stats

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about a second for a large vocabulary), on the compile thread."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = from_tokenizer(self._hf_tokenizer)
            # Building it goes through a copy of the vocabulary's every token: 70 MB of freed heap glibc
            # kept for Qwen2.5's 151k tokens.
            return_freed_memory()
        return self._ll_tokenizer

    def tokenizer_ready(self) -> Future[llguidance.LLTokenizer]:
        """The grammar engine's view of the vocabulary, built once on the compile thread (seconds for a
        150k vocabulary, many more on a busy CPU). A one-off cost of the server, not of the first spec:
        callers wait for it before they time a compile, and a server with a tool-call grammar starts it
        at load so an agent's first request does not pay for it."""
        with self._lock:
            if self._tokenizer_future is None:
                self._tokenizer_future = self._pool.submit(lambda: self.ll_tokenizer)
            return self._tokenizer_future

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The prototype matcher of the spec, compiled in the background (or found in the cache)."""
        key = params.cache_key()
        if len(key) > self.limits.max_grammar_bytes:  # refused before any work: a done, failed future
            failed: Future[CompiledGrammar] = Future()
            failed.set_exception(
                GrammarError(
                    params.kind,
                    (
                        f"the spec is {len(key)} bytes; the server's limit (--max-grammar-bytes) is "
                        f"{self.limits.max_grammar_bytes}"
                    ),
                )
            )
            return failed
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            self._charge(key, len(key))
        future.add_done_callback(lambda f: self._settle(key, f))
        return future

    def _charge(self, key: str, size: int) -> None:
        """Count `size` bytes for `key`, then evict the least recently used until both bounds hold."""
        self.cache_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        while len(self._cache) > 1 and (
            len(self._cache) > self._cache_size or self.cache_bytes > self.limits.grammar_cache_bytes
        ):
            old, _ = self._cache.popitem(last=False)
            self.cache_bytes -= self._sizes.pop(old, 0)

    def forget(self, params: StructuredOutputsParams) -> None:
        """Drop a spec from the cache (its compile ran past the time limit: it is not kept)."""
        key = params.cache_key()
        with self._lock:
            if self._cache.pop(key, None) is not None:
                self.cache_bytes -= self._sizes.pop(key, 0)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking form of `submit` (raises GrammarError); the cache is settled when it returns.

        A future wakes its waiters before it runs its done callbacks, so without the explicit settle a
        failed spec could still be cached for a moment after `compile` raised.
        """
        future = self.submit(params)
        try:
            return future.result()
        finally:
            self._settle(params.cache_key(), future)

    def _settle(self, key: str, future: Future[CompiledGrammar]) -> None:
        """A failed compile leaves the cache; a good one is charged its grammar's bytes."""
        with self._lock:
            if self._cache.get(key) is not future:
                return
            if future.cancelled() or future.exception() is not None:
                del self._cache[key]
                self.cache_bytes -= self._sizes.pop(key, 0)
            else:
                self._charge(key, len(key) + future.result().num_bytes)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        text = grammar_text(params)
        tokenizer = self.ll_tokenizer
        try:
            matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=self.limits.parser_limits())
        except Exception as exc:  # llguidance reports grammar errors on the matcher, but be sure: a 400
            raise GrammarError(params.kind, str(exc) or type(exc).__name__) from None
        self.num_compiles += 1
        if matcher.is_error():
            raise GrammarError(params.kind, matcher.get_error())
        _probe(matcher, tokenizer, params.kind)
        return CompiledGrammar(matcher, tokenizer.vocab_size, len(text))

    def make_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A new request's grammar state; it becomes ready when the compile finishes."""
        return GrammarState(self.submit(params), params.reasoning_end_token_ids)

    def __len__(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
