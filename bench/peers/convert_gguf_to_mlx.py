"""Convert a GGUF (default: the embedded SmolLM2) to an MLX model directory with fp32 weights for mlx_lm.

It reuses metalserve's GGUF loader, so mlx-lm's server runs the very weights metalserve runs: dequantized
to fp32 once, Q/K rows un-permuted, tied embeddings. Usage:
    .venv/bin/python bench/peers/convert_gguf_to_mlx.py [--gguf PATH] [--out /work/peers/smollm2-fp32-mlx]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import metalserve  # noqa: F401  - loads the optimized BLAS before MLX
from metalserve.loader import load_model

DEFAULT_OUT = "/work/peers/smollm2-fp32-mlx"


def convert(gguf: str | None, out: Path) -> dict[str, object]:
    """Write config.json, model.safetensors and the tokenizer files to `out`; returns the config."""
    from mlx_lm.utils import save_config, save_model

    loaded = load_model(gguf, weights="dequantize")
    config = dict(loaded.config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    # mlx_lm reads its stop tokens from here: the chat turn end (<|im_end|>) as well as the plain EOS.
    config["eos_token_id"] = sorted(loaded.eos_token_ids)
    config["torch_dtype"] = "float32"
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, loaded.model)
    save_config(config, config_path=out / "config.json")
    loaded.tokenizer.save_pretrained(str(out))
    print(f"{loaded.describe()}\nwrote {out}")
    return config


def check(out: Path, prompt: str = "What is the capital of France?") -> str:
    """Greedy answer of mlx_lm on the converted directory (the FACTS.md answer mentions Paris)."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(out))
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return str(generate(model, tokenizer, text, max_tokens=16, verbose=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the embedded default model)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output model directory (outside the repo)")
    parser.add_argument("--no-check", action="store_true", help="skip the greedy check with mlx_lm")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    convert(args.gguf, Path(args.out))
    print(f"converted in {time.perf_counter() - start:.1f} s")
    if not args.no_check:
        answer = check(Path(args.out))
        print(f"mlx_lm greedy answer: {answer!r}")
        if "Paris" not in answer:
            print("error: the converted model does not answer 'Paris'; weights are wrong", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
