"""What grammar-constrained decoding costs per decode step on the default model, at batch 1, 8 and 32.

    .venv/bin/python bench/grammar.py [--batches 1 8 32] [--steps 24]

For each batch the same requests decode twice: unconstrained, then each under one JSON schema. The
constrained run times the grammar work inside its steps: the batched mask fill plus the masked select
on the logits (the sampler's grammar step) and the matchers' advance (one token per request per step).
The share is that work over the decode step (the constrained one, and the unconstrained one since
step times on a shared machine move more than the grammar costs); the target is under 5 % at batch 8.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import metalserve.executor.sampler as sampler_module
from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import load_engine_core
from metalserve.structured.compiler import GrammarCompiler
from metalserve.structured.params import StructuredOutputsParams
from metalserve.structured.state import GrammarState

# Long enough that no request completes its grammar within the measured steps.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 20},
        "population": {"type": "integer"},
    },
    "required": ["city", "facts", "population"],
    "additionalProperties": False,
}
QUESTION = "Describe city number {i} as JSON: its name, twenty facts, and its population."


class Timer:
    """Wall time spent inside wrapped functions since the last `take`."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        return timed

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


def summarize(
    step_free_s: list[float], step_json_s: list[float], mask_s: list[float], advance_s: list[float]
) -> dict[str, float]:  # noqa: E501
    """Per-step times in ms (median steps: other work on the machine lands on a few of them), and the
    grammar work as a share of the constrained step and of the unconstrained one, in percent."""
    free, step = statistics.median(step_free_s) * 1e3, statistics.median(step_json_s) * 1e3
    grammar = (statistics.fmean(mask_s) + statistics.fmean(advance_s)) * 1e3
    return {
        "step_free_ms": free,
        "step_json_ms": step,
        "mask_ms": statistics.fmean(mask_s) * 1e3,
        "advance_ms": statistics.fmean(advance_s) * 1e3,
        "share_pct": 100 * grammar / step,
        "share_of_free_pct": 100 * grammar / free,
    }


def decode(
    core: EngineCore, requests: list[Request], steps: int, timers: tuple[Timer, Timer]
) -> tuple[list[float], list[float], list[float]]:  # noqa: E501
    """Run until every request has `steps` outputs; per pure decode step: its time, mask and advance time."""
    for r in requests:
        core.add_request(r)
    step_s, mask_s, accept_s = [], [], []
    while core.has_unfinished_requests():
        decoding = all(r.num_output_tokens > 0 for r in requests)
        for t in timers:
            t.take()
        start = time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - start
        if decoding and any(not r.status.finished for r in requests):
            step_s.append(elapsed)
            mask_s.append(timers[0].take())
            accept_s.append(timers[1].take())
    return step_s, mask_s, accept_s


def requests_for(loaded: Any, batch: int, steps: int, tag: str, compiler: GrammarCompiler | None) -> list[Request]:
    spec = StructuredOutputsParams(json=SCHEMA) if compiler else None
    out = []
    for i in range(batch):
        messages = [{"role": "user", "content": QUESTION.format(i=i)}]
        prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(loaded.tokenizer.encode(prompt, add_special_tokens=False))
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True, structured_outputs=spec)
        r = Request(f"{tag}{batch}-{i}", ids, params, eos_token_ids=loaded.eos_token_ids)
        if compiler is not None and spec is not None:
            r.structured = compiler.make_state(spec)
        out.append(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=24, help="decode steps measured per batch")
    a = p.parse_args()
    config = EngineConfig(max_model_len=1024, max_num_seqs=max(a.batches), enable_prefix_caching=False)
    core, loaded = load_engine_core(config)
    compiler = GrammarCompiler(loaded.tokenizer)
    compiler.compile(StructuredOutputsParams(json=SCHEMA))  # compile (and build the vocabulary) outside the timing
    mask_timer, accept_timer = Timer(), Timer()
    sampler_module.apply_grammar_masks = mask_timer.wrap(sampler_module.apply_grammar_masks)  # type: ignore[assignment]
    GrammarState.accept = accept_timer.wrap(GrammarState.accept)  # type: ignore[method-assign]
    timers = (mask_timer, accept_timer)
    print(
        f"{'batch':>5} {'step free ms':>12} {'step json ms':>12} {'mask ms':>8} {'advance ms':>10} "
        f"{'share (json step)':>17} {'share (free step)':>17}"
    )
    for batch in a.batches:
        free, _, _ = decode(core, requests_for(loaded, batch, a.steps, "free", None), a.steps, timers)
        json_s, mask_s, accept_s = decode(core, requests_for(loaded, batch, a.steps, "json", compiler), a.steps, timers)
        s = summarize(free, json_s, mask_s, accept_s)
        print(
            f"{batch:>5} {s['step_free_ms']:>12.1f} {s['step_json_ms']:>12.1f} {s['mask_ms']:>8.2f} "
            f"{s['advance_ms']:>10.2f} {s['share_pct']:>16.1f}% {s['share_of_free_pct']:>16.1f}%"
        )


if __name__ == "__main__":
    main()
