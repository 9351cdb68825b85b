"""How far `--cpu-int8-activations` moves the default model from its fp32 self, teacher-forced.

    PYTHONPATH=$PWD NUMBA_NUM_THREADS=2 .venv/bin/python bench/cpu_int8_accuracy.py [--prompts 4] [--tokens 32]

transformers' reference prompts and greedy continuations (tests/data/smollm2_reference.json) are fed to the
model kept in its codes, with int8 activations off and on, and to the fp32 dequantized model; at every
decode step (the prompt's own step is a prefill, never int8) it compares log-probabilities with fp32's: the
reference token's, the top token, and the largest difference among tokens within 10 nats of the top.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# isort: off
import metalserve  # noqa: F401  (before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from metalserve.kernels.cpu import int8_dot
from metalserve.loader import load_model

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_reference.json"


def forced_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """Log-probabilities after the prompt and after each of `tokens` but the last, fed one at a time."""
    cache = make_prompt_cache(model)
    steps = [np.array(model(mx.array([prompt]), cache=cache)[0, -1])]
    steps += [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in tokens[:-1]]
    return [s - np.logaddexp.reduce(s) for s in steps]


def compare(mode: str, cases: list[dict[str, Any]], fp32: Any) -> dict[str, float]:
    int8_dot.set_mode(mode)  # before the load: the projections read it when they are built
    model = load_model(None).model
    top = steps = 0
    chosen, near = [], 0.0
    for case in cases:
        tokens = case["greedy_tokens"]
        ours = forced_logprobs(model, case["prompt_ids"], tokens)
        want = forced_logprobs(fp32, case["prompt_ids"], tokens)
        for a, b, token in zip(ours[1:], want[1:], tokens[1:], strict=True):
            steps += 1
            top += int(a.argmax() == b.argmax())
            chosen.append(abs(float(a[token] - b[token])))
            near = max(near, float(np.abs(a - b)[b > b.max() - 10].max()))
    return {"steps": steps, "top": top, "mean": float(np.mean(chosen)), "max": max(chosen), "near": near}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    cases = [
        {**c, "greedy_tokens": c["greedy_tokens"][: args.tokens]}
        for c in json.loads(REFERENCE.read_text())["prompts"][: args.prompts]
    ]
    fp32 = load_model(None, weights="dequantize").model
    before = int8_dot.enabled()
    try:
        results = {mode: compare(mode, cases, fp32) for mode in ("off", "on")}
    finally:
        int8_dot.set_mode("on" if before else "off")
    for mode, r in results.items():
        print(
            f"int8 {mode}: {r['steps']} decode steps; top token equal to fp32's {r['top']}/{r['steps']}; "
            f"|d logprob| of the reference token mean {r['mean']:.4f}, max {r['max']:.4f}; "
            f"largest within 10 nats of the top {r['near']:.4f}"
        )
    return results


if __name__ == "__main__":
    main()
