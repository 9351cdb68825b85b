"""The KV disk tier on a hybrid model: a second turn's TTFT after a restart, against recompute.

    .venv/bin/python bench/disk_tier_hybrid.py [--prompt 3000] [--answer 24] [--turn 200] [--hidden 512]

A random-weight qwen3_5 (gated-delta and full-attention layers; `--hidden`, `--layers`) served by the real
engine (EngineCore, no HTTP). Turn 1 (`--prompt` random tokens, `--answer` greedy tokens) runs with
--kv-disk-dir; the engine is rebuilt on the same directory (a restart), and turn 2 (turn 1, its answer and
`--turn` new tokens) is timed to its first token; then the same turn on a fresh engine without the disk
tier. Prefill chunks of `--budget` tokens end on block boundaries, and so does a decode step that fills a
block: the loaded prefix ends at the last such boundary (inside turn 1's answer). Greedy tokens compared.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from metalserve.config import EngineConfig  # noqa: E402
from metalserve.engine.core import EngineCore  # noqa: E402
from metalserve.loader import LoadedModel  # noqa: E402
from metalserve.request import Request  # noqa: E402
from metalserve.sampling_params import SamplingParams  # noqa: E402
from metalserve.serving.build import build_engine_core
from tests.models.golden import loaded_of  # noqa: E402
from tests.models.hybrid_tiny import _BASE, CONFIGS  # noqa: E402

VOCAB = 4096


def hybrid_model(hidden: int, layers: int) -> LoadedModel:
    mx.random.seed(0)
    module = importlib.import_module("mlx_lm.models.qwen3_5")
    heads = hidden // 64
    config = {
        **_BASE,
        **CONFIGS["qwen3_5"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64,
        "linear_num_value_heads": heads,
        "linear_num_key_heads": max(1, heads // 2),
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "full_attention_interval": 4,
        "vocab_size": VOCAB,
    }
    model = module.Model(module.ModelArgs.from_dict({"model_type": "qwen3_5", **config}))
    mx.eval(model.parameters())
    return loaded_of(model, "qwen3_5", 16384)


def make_core(args: argparse.Namespace, directory: str | None) -> EngineCore:
    config = EngineConfig(
        kv_cache_memory=1 << 30,
        block_size=16,
        max_num_batched_tokens=args.budget,
        max_model_len=16384,
        kv_disk_dir=directory,
    )
    return build_engine_core(config, hybrid_model(args.hidden, args.layers))


def first_token(core: EngineCore, prompt: list[int], n: int, rid: str) -> tuple[float, list[int]]:
    """Seconds to the first token, and the greedy tokens."""
    core.add_request(Request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    start, ttft, tokens = time.perf_counter(), 0.0, []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.new_token_ids and not tokens:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
    return ttft, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=3000, help="turn 1's prompt tokens")
    ap.add_argument("--answer", type=int, default=24, help="turn 1's answer tokens")
    ap.add_argument("--turn", type=int, default=200, help="turn 2's new tokens")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    turn1 = rng.integers(0, VOCAB, args.prompt).tolist()
    with tempfile.TemporaryDirectory() as directory:
        core = make_core(args, directory)
        ttft1, answer = first_token(core, turn1, args.answer, "turn1")
        core.close()
        turn2 = turn1 + answer + rng.integers(0, VOCAB, args.turn).tolist()
        core = make_core(args, directory)  # the restart
        ttft_disk, disk_tokens = first_token(core, turn2, 8, "turn2")
        stats = core.make_stats().connector
        core.close()
    ttft_cold, cold_tokens = first_token(make_core(args, None), turn2, 8, "turn2")
    hits = stats.hits if stats is not None else 0
    print(f"turn 1: {args.prompt} tokens, TTFT {ttft1:.2f} s")
    print(
        f"turn 2 after a restart: {len(turn2)} tokens, {hits} from disk: TTFT {ttft_disk:.2f} s; "
        f"recompute {ttft_cold:.2f} s; ratio {ttft_disk / ttft_cold:.3f}; tokens equal: {disk_tokens == cold_tokens}"
    )


if __name__ == "__main__":
    main()
