"""Which KV page format is worth building: perplexity of candidate formats against the 16-bit controls, on
several texts and models, through the engine's own prompt-logprobs path on MLX ops.

Each variant quantizes K and V as they are written and attends the dequantized values (what a page of
that format would give back), in the Hadamard-rotated basis that quantized pages use
(executor/attention/rotation.py). `q4` and `int8` here are the formats `--kv-cache-dtype` stores
(kv_quant.py measures those through the real pages and kernels); the others exist only here:
- `k8v4` / `k4v8`: keys in int8 and values in q4, or the other way round (llama.cpp's -ctk / -ctv);
- `q4g16`: q4 with groups of 16 channels (48 bytes per vector of 64, against 40 for g32);
- `q4mse`: q4 whose range per group is searched for the least squared error (same bytes as q4).
Controls: `float16` and `bfloat16` pages (K/V rounded as written), and `auto` (the float32 baseline).

    .venv/bin/python bench/kv_quant_variants.py                       # the default model, every text
    .venv/bin/python bench/kv_quant_variants.py --model PATH.gguf --variants auto,q4,int8,k8v4,bfloat16

Texts: bench/data/sonnet.txt (what kv_quant.py measures), and two held out from every choice made here:
heldout_gpl3.txt (prose: part of the GPL-3 preamble, /usr/share/common-licenses/GPL-3) and
heldout_textwrap_py.txt (code: a stretch of CPython 3.11's Lib/textwrap.py).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import kv_quant  # type: ignore[import-not-found]  # bench/ is the script's directory
import mlx.core as mx

from metalserve.executor.attention.base import AttentionCall
from metalserve.executor.attention.mlx import MlxAttention, PortableKV
from metalserve.executor.attention.mlx_ops import AttentionPlan
from metalserve.executor.attention.rotation import RotatedPages

DATA = Path(__file__).resolve().parent / "data"
TEXTS = ("sonnet.txt", "heldout_gpl3.txt", "heldout_textwrap_py.txt")
Quantizer = Callable[[mx.array], mx.array]


def q4(x: mx.array, group: int = 32, search: bool = False) -> mx.array:
    """Affine 4-bit groups as the pages store them (float16 scale and bias); `search`: also try ranges
    shrunk by up to 25% from either end and keep the least squared error per group."""
    d = x.shape[-1]
    xg = x.reshape(*x.shape[:-1], d // group, group)
    low, high = mx.min(xg, axis=-1, keepdims=True), mx.max(xg, axis=-1, keepdims=True)
    best: mx.array | None = None
    err_best = mx.array(0.0)
    for shrink in (0.0, 0.05, 0.1, 0.15, 0.2, 0.25) if search else (0.0,):
        for low_share in (0.0, 0.5, 1.0) if search else (0.0,):
            cut = (high - low) * shrink
            lo, hi = low + cut * low_share, high - cut * (1 - low_share)
            s = ((hi - lo) / 15.0).astype(mx.float16).astype(mx.float32)
            b = lo.astype(mx.float16).astype(mx.float32)
            y = mx.clip(mx.round((xg - b) / mx.where(s > 0, s, 1.0)), 0, 15) * s + b
            err = mx.sum((y - xg) ** 2, axis=-1, keepdims=True)
            if best is None:
                best, err_best = y, err
            else:
                better = err < err_best
                best, err_best = mx.where(better, y, best), mx.where(better, err, err_best)
    assert best is not None
    return best.reshape(x.shape)


def int8(x: mx.array) -> mx.array:
    s = (mx.max(mx.abs(x), axis=-1, keepdims=True) / 127.0).astype(mx.float16).astype(mx.float32)
    return mx.clip(mx.round(x / mx.where(s > 0, s, 1.0)), -127, 127) * s


VARIANTS: dict[str, tuple[Quantizer, Quantizer]] = {
    "q4": (q4, q4),
    "int8": (int8, int8),
    "k8v4": (int8, q4),
    "k4v8": (q4, int8),
    "q4g16": (lambda x: q4(x, 16), lambda x: q4(x, 16)),
    "q4mse": (lambda x: q4(x, search=True), lambda x: q4(x, search=True)),
}
BYTES_PER_VECTOR_64 = {"auto": 256, "float16": 128, "bfloat16": 128, "q4": 40, "int8": 66, "k8v4": 53, "k4v8": 53}
BYTES_PER_VECTOR_64 |= {"q4g16": 48, "q4mse": 40}  # K and V averaged, per head and token, head dim 64


class FakeQuantPages(MlxAttention):
    """MLX ops over K and V that went through a page format and back (float pages underneath)."""

    def __init__(self, keys: Quantizer, values: Quantizer) -> None:
        self.keys, self.values = keys, values

    def forward(self, call: AttentionCall[PortableKV, AttentionPlan]) -> mx.array:
        assert call.v is not None
        k = self.keys(call.k.astype(mx.float32)).astype(call.k.dtype)
        v = self.values(call.v.astype(mx.float32)).astype(call.v.dtype)
        return super().forward(call._replace(k=k, v=v))


class AlwaysRotated(RotatedPages):
    """RotatedPages rotates quantized pools only; these pools are float, so rotate every layer."""

    def forward(self, call: AttentionCall[PortableKV, AttentionPlan]) -> mx.array:
        assert call.v is not None
        rotated = call._replace(q=self.rotate(call.q), k=self.rotate(call.k), v=self.rotate(call.v))
        return self.rotate(self.inner.forward(rotated))


def backend_for(name: str) -> MlxAttention | RotatedPages:
    if name == "auto":
        return MlxAttention()
    if name in ("float16", "bfloat16"):
        return kv_quant.RoundedPages(getattr(mx, name))
    return AlwaysRotated(FakeQuantPages(*VARIANTS[name]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file or model directory (default: the embedded one)")
    parser.add_argument("--texts", default=",".join(TEXTS), help="files under bench/data, comma-separated")
    parser.add_argument("--variants", default="auto,float16,bfloat16,q4,int8,k8v4,k4v8,q4g16,q4mse")
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--windows", type=int, default=2, help="windows per text (at most what the text holds)")
    args = parser.parse_args()
    names = args.variants.split(",")
    if names[0] != "auto":
        names.insert(0, "auto")  # the baseline every row is compared with
    rows: list[str] = []
    for text in args.texts.split(","):
        core, loaded = kv_quant.engine("auto", "mlx", args.window + 128, model=args.model)
        ids = list(loaded.tokenizer.encode((DATA / text).read_text()))
        n = min(args.windows, len(ids) // args.window)
        base = math.nan
        for name in names:
            start = time.perf_counter()
            core.runner.backend = backend_for(name)
            ppl = kv_quant.perplexity(core, ids, args.window, n)
            base = ppl if name == "auto" else base
            size = BYTES_PER_VECTOR_64.get(name, "")
            row = f"| {text} | {name} | {size} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% |"
            rows.append(row)
            print(f"{row}  ({time.perf_counter() - start:.0f} s)", flush=True)
        del core, loaded
        mx.clear_cache()
    print(f"\n{args.model or 'default model'}: {n} windows of {args.window} tokens per text")
    print("| text | pages | bytes per K or V vector of 64 | perplexity | vs auto |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
