"""How far `--cpu-int8-activations` moves a model from its fp32 self, teacher-forced.

    PYTHONPATH=$PWD NUMBA_NUM_THREADS=2 .venv/bin/python bench/cpu_int8_accuracy.py [--prompts 4] [--tokens 32] \
        [--model GGUF]

transformers' reference prompts and greedy continuations (tests/data/smollm2_reference.json) are fed to the
model kept in its codes, with int8 activations off and on, and to the fp32 dequantized model; at every
decode step (the prompt's own step is a prefill, never int8) it compares log-probabilities with fp32's: the
reference token's, the top token, and the largest difference among tokens within 10 nats of the top.
`--model` (another GGUF, e.g. the coder 0.5B whose Q5_0 and Q6_K take their own int8 kernels): the same
prompts' texts in its chat template, continued greedily by its fp32 self, which is then the reference.
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


def compare(mode: str, cases: list[dict[str, Any]], fp32: Any, path: str | None = None) -> dict[str, float]:
    int8_dot.set_mode(mode)  # before the load: the projections read it when they are built
    model = load_model(path).model
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


def own_cases(loaded: Any, texts: list[str], tokens: int) -> list[dict[str, Any]]:
    """`texts` as chat prompts in `loaded`'s template, with `loaded`'s own greedy continuations."""
    cases = []
    for text in texts:
        messages = [{"role": "user", "content": text}]
        templated = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = list(loaded.tokenizer.encode(templated, add_special_tokens=False))
        cache = make_prompt_cache(loaded.model)
        logits = loaded.model(mx.array([prompt]), cache=cache)[0, -1]
        greedy = [int(mx.argmax(logits).item())]
        while len(greedy) < tokens:
            greedy.append(int(mx.argmax(loaded.model(mx.array([[greedy[-1]]]), cache=cache)[0, -1]).item()))
        cases.append({"prompt_ids": prompt, "greedy_tokens": greedy})
    return cases


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded default model)")
    args = ap.parse_args(argv)
    reference = json.loads(REFERENCE.read_text())["prompts"][: args.prompts]
    fp32_loaded = load_model(args.model, weights="dequantize")
    fp32 = fp32_loaded.model
    if args.model is None:
        cases = [{**c, "greedy_tokens": c["greedy_tokens"][: args.tokens]} for c in reference]
    else:
        cases = own_cases(fp32_loaded, [c["text"] for c in reference], args.tokens)
    before = int8_dot.enabled()
    try:
        results = {mode: compare(mode, cases, fp32, args.model) for mode in ("off", "on")}
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
