"""How far `--cpu-int8-activations` (and `--cpu-bf16-prefill`) move a model from its fp32 self, teacher-forced.

    PYTHONPATH=$PWD NUMBA_NUM_THREADS=2 .venv/bin/python bench/cpu_int8_accuracy.py [--prompts 4] [--tokens 32] \
        [--model GGUF] [--bf16-prefill]

transformers' reference prompts and greedy continuations (tests/data/smollm2_reference.json) are fed to the
model kept in its codes, with int8 activations off and on, and to the fp32 dequantized model; at every
decode step (the prompt's own step is a prefill, never int8) it compares log-probabilities with fp32's: the
reference token's, the top token, and the largest difference among tokens within 10 nats of the top.
`--model` (another GGUF, e.g. the coder 0.5B whose Q5_0 and Q6_K take their own int8 kernels): the same
prompts' texts in its chat template, continued greedily by its fp32 self, which is then the reference.
`--bf16-prefill`: a third arm, bfloat16 prefill GEMMs (int8 off); every prompt then starts with the other
prompts' texts, so that its prefill is long enough for the GEMM route, and the fp32 self's greedy continuations
are the reference. Each arm also reports the prompt's own step (the first token), which only bf16 moves.
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

from metalserve.kernels.cpu import gemm, int8_dot
from metalserve.loader import load_model

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_reference.json"


def forced_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """Log-probabilities after the prompt and after each of `tokens` but the last, fed one at a time."""
    cache = make_prompt_cache(model)
    steps = [np.array(model(mx.array([prompt]), cache=cache)[0, -1])]
    steps += [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in tokens[:-1]]
    return [s - np.logaddexp.reduce(s) for s in steps]


def compare(
    mode: str, cases: list[dict[str, Any]], fp32: Any, path: str | None = None, bf16: str = "off"
) -> dict[str, float]:
    int8_dot.set_mode(mode)  # before the load: the projections read it when they are built
    gemm.set_bf16_mode(bf16)
    model = load_model(path).model
    top = steps = prompt_top = 0
    chosen, first, near = [], [], 0.0
    for case in cases:
        tokens = case["greedy_tokens"]
        ours = forced_logprobs(model, case["prompt_ids"], tokens)
        want = forced_logprobs(fp32, case["prompt_ids"], tokens)
        prompt_top += int(ours[0].argmax() == want[0].argmax())
        first.append(abs(float(ours[0][tokens[0]] - want[0][tokens[0]])))
        for a, b, token in zip(ours[1:], want[1:], tokens[1:], strict=True):
            steps += 1
            top += int(a.argmax() == b.argmax())
            chosen.append(abs(float(a[token] - b[token])))
            near = max(near, float(np.abs(a - b)[b > b.max() - 10].max()))
    return {
        "steps": steps,
        "top": top,
        "mean": float(np.mean(chosen)),
        "max": max(chosen),
        "near": near,
        "prompts": len(cases),
        "prompt_top": prompt_top,
        "prompt_max": max(first),
    }


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
    ap.add_argument("--bf16-prefill", action="store_true", help="a third arm: --cpu-bf16-prefill on, long prompts")
    args = ap.parse_args(argv)
    reference = json.loads(REFERENCE.read_text())["prompts"][: args.prompts]
    fp32_loaded = load_model(args.model, weights="dequantize")
    fp32 = fp32_loaded.model
    if args.bf16_prefill:  # each prompt behind all the others' texts: a prefill of GEMM_MIN_ROWS rows and more
        every = " ".join(c["text"] for c in json.loads(REFERENCE.read_text())["prompts"])
        cases = own_cases(fp32_loaded, [f"{every}\n\n{c['text']}" for c in reference], args.tokens)
    elif args.model is None:
        cases = [{**c, "greedy_tokens": c["greedy_tokens"][: args.tokens]} for c in reference]
    else:
        cases = own_cases(fp32_loaded, [c["text"] for c in reference], args.tokens)
    arms = {"off": ("off", "off"), "on": ("on", "off")} | ({"bf16": ("off", "on")} if args.bf16_prefill else {})
    before = int8_dot.enabled(), gemm.host_gemm().bf16
    try:
        results = {name: compare(i8, cases, fp32, args.model, bf16) for name, (i8, bf16) in arms.items()}
    finally:
        int8_dot.set_mode("on" if before[0] else "off")
        gemm.set_bf16_mode("on" if before[1] else "off")
    for name, r in results.items():
        label = "bf16 prefill" if name == "bf16" else f"int8 {name}"
        print(
            f"{label}: prompt steps {r['prompts']}, top token equal to fp32's {r['prompt_top']}/{r['prompts']}, "
            f"|d logprob| max {r['prompt_max']:.4f}; {r['steps']} decode steps; top token equal to fp32's "
            f"{r['top']}/{r['steps']}; |d logprob| of the reference token mean {r['mean']:.4f}, max {r['max']:.4f}; "
            f"largest within 10 nats of the top {r['near']:.4f}"
        )
    return results


if __name__ == "__main__":
    main()
