"""What a grammar may cost (ServerSettings' grammar flags; compiler.py applies them). No llguidance
import here, so the CLI reads these flags without loading it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from metalserve.flags import flag

if TYPE_CHECKING:
    import llguidance


@dataclass(frozen=True)
class GrammarLimits:
    """Spec text, parser symbols, lexer states, compile time, and cache room."""

    max_grammar_bytes: int = flag(
        256 * 1024, "largest structured-output spec (JSON schema, regex, choices, grammar); 400 above it"
    )
    max_grammar_symbols: int = 50_000  # llguidance's max_grammar_size (its default 500,000 panics first)
    max_lexer_states: int = 100_000  # about 1-2 kB each, per llguidance
    # The API answers a 400 past this (the compile thread finishes alone).
    grammar_compile_timeout: float = flag(10.0, "seconds a grammar may take to compile; its request gets a 400 past it")
    cache_size: int = 256  # compiled grammars kept, at most
    grammar_cache_bytes: int = flag(
        64 * 1024 * 1024, "compiled grammars kept for reuse (LRU, counted by grammar text bytes)"
    )

    def __post_init__(self) -> None:
        if self.max_grammar_bytes < 1 or self.grammar_cache_bytes < 0:
            raise ValueError("--max-grammar-bytes must be >= 1 and --grammar-cache-bytes >= 0")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("--grammar-compile-timeout must be > 0")

    def parser_limits(self) -> llguidance.LLParserLimits:
        import llguidance

        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_symbols, max_lexer_states=self.max_lexer_states, verbose_errors=False
        )
