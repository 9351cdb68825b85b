"""What a request constrains its output to: one grammar spec (vLLM's `structured_outputs` field)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

# The spec fields, exactly one of which a request sets.
SPEC_FIELDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One grammar spec; `reasoning_end_token_ids` defers it until that token sequence is in the output."""

    json: dict[str, Any] | str | None = None  # a JSON schema (object or its text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance) or GBNF text
    structural_tag: str | None = None
    reasoning_end_token_ids: tuple[int, ...] = ()  # enforce only after this token sequence appears in the output

    def __post_init__(self) -> None:
        given = [name for name in SPEC_FIELDS if _is_set(getattr(self, name))]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                + ", ".join(SPEC_FIELDS)
                + (f"; got {', '.join(given)}" if given else "; got none")
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        object.__setattr__(self, "reasoning_end_token_ids", tuple(self.reasoning_end_token_ids))

    @property
    def kind(self) -> str:
        """The name of the one spec field that is set."""
        return next(name for name in SPEC_FIELDS if _is_set(getattr(self, name)))

    def cache_key(self) -> str:
        """A canonical text of the grammar spec (not the reasoning gate): equal specs compile once."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            # Kept as text when it does not parse; the compiler reports it as an invalid schema.
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        if isinstance(value, tuple):
            value = list(value)
        return json.dumps([self.kind, value], sort_keys=True, separators=(",", ":"))


def _is_set(value: object) -> bool:
    return value is not None and value is not False
