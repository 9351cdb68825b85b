"""One request's grammar: its matcher (a copy of the compiled prototype) and the reasoning gate.

The state lives on the engine's Request, so it survives preemption by recompute (the output tokens are
kept and so is the matcher). `replay` rebuilds it from the output tokens whenever the two disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple

import llguidance


class CompiledGrammar(NamedTuple):
    """A prototype matcher (never advanced; requests take deep copies) and its tokenizer's vocabulary size."""

    matcher: llguidance.LLMatcher
    vocab_size: int
    num_bytes: int = 0  # the grammar text's size, charged to the compile cache


class GrammarState:
    """Waits for its compile, then advances one sampled token at a time (`accept`)."""

    def __init__(self, compiled: Future[CompiledGrammar], reasoning_end_token_ids: Sequence[int] = ()) -> None:
        self._compiled = compiled
        self._gate = tuple(reasoning_end_token_ids)
        self.matcher: llguidance.LLMatcher | None = None
        self.vocab_size = 0  # the tokenizer's, known once compiled
        self.error: str | None = None  # the compile failed, or a token the grammar refused was forced in
        self._reset_progress()

    def _reset_progress(self) -> None:
        self.enforcing = not self._gate  # False until the reasoning-end sequence is in the output
        self.terminated = False  # the output completed the grammar
        self.num_seen = 0  # output tokens accepted so far
        self._tail: list[int] = []

    def is_ready(self) -> bool:
        """True once the compile has finished (successfully or not); the scheduler waits until then."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        exc = self._compiled.exception()
        if exc is not None:
            self.error = str(exc)
        else:
            compiled = self._compiled.result()
            self.matcher, self.vocab_size = compiled.matcher.deep_copy(), compiled.vocab_size
        return True

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is masked by the grammar."""
        return self.enforcing and self.matcher is not None and not self.terminated

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; True when the request must end (grammar complete or broken)."""
        self.num_seen += 1
        if not self.enforcing:
            self._tail = (self._tail + [token_id])[-len(self._gate) :]
            self.enforcing = tuple(self._tail) == self._gate
            return False
        if self.matcher is None or self.terminated:
            return self.terminated
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            # Its first line only: llguidance appends a dump of the parser state.
            error = self.matcher.get_error().strip().split("\n", 1)[0][:300]
            self.error = error or f"token {token_id} is not allowed by the grammar"
            self.terminated = True
        elif self.matcher.is_stopped():
            self.terminated = True
        return self.terminated

    def replay(self, output_token_ids: Sequence[int]) -> None:
        """Start over and accept these tokens (the output as it now stands)."""
        if self.matcher is None:
            return
        self.matcher.reset()
        self._reset_progress()
        for token_id in output_token_ids:
            self.accept(token_id)
