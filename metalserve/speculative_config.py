"""`--speculative-config`, as vLLM spells it, parsed and validated once at start-up (EngineConfig holds
it; the drafting and the verifying live in spec_decode/)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a window past this only costs: acceptance decays geometrically
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": {"method", "model", "num_speculative_tokens"},
}


class SpeculativeConfigError(ValueError):
    """A `--speculative-config` that cannot work; the message says which key to change."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens` drafts per step; prompt lookup matches n-grams of min..max tokens."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: the draft model (a GGUF file, directory or hub id; None: embedded)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        err = SpeculativeConfigError
        if self.method not in SPEC_METHODS:
            raise err(f"--speculative-config: unknown method {self.method!r} (known: {', '.join(SPEC_METHODS)})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise err(f"--speculative-config: num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not isinstance(lo, int) or not isinstance(hi, int) or lo < 1:
            raise err(f"--speculative-config: prompt_lookup_min must be an integer >= 1, got {lo!r}")
        if hi < lo:
            raise err(f"--speculative-config: prompt_lookup_max ({hi}) is less than prompt_lookup_min ({lo})")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(data, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        method = data.get("method")
        if method not in _KEYS:
            raise SpeculativeConfigError(
                f"--speculative-config: unknown method {method!r} (known: {', '.join(SPEC_METHODS)})"
            )
        unknown = sorted(set(data) - _KEYS[method])
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown keys for {method}: {', '.join(unknown)}")
        if "num_speculative_tokens" not in data:
            raise SpeculativeConfigError("--speculative-config: num_speculative_tokens is required")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config is not valid JSON: {e}") from e
        return cls.from_dict(data)
