"""The cost of LoRA adapters in a packed step: decode steps of 8 requests over 4 adapters against 8 base
requests, on one engine, in the same run; and the base model without --enable-lora beside them.

    PYTHONPATH=$PWD .venv/bin/python bench/lora_bench.py [--hidden 512] [--layers 8] [--rank 16] [--rounds 3]
    PYTHONPATH=$PWD .venv/bin/python bench/lora_bench.py --default-model [--rank 16] [--rounds 3]

A random-weight llama (mlx-lm's class), or with --default-model the embedded SmolLM2-135M GGUF kept in its
codes (on MLX's CPU backend: the CPU fast path, every step in the one-call numba decoder), and random
adapters of its shape made with mlx-lm's LoRA classes on every attention and MLP projection. Steps are
timed after every prompt is prefilled (decode steps only); variants alternate, round by round, and the
median step of each is printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

# isort: off
import metalserve  # noqa: F401  (before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.lora.request import LoraRequest
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.lora.tiny_adapters import ALL_KEYS, loaded_of, make_mlx_lm_adapter

PROMPT_TOKENS = 64
KEYS = [*ALL_KEYS, "mlp.gate_proj", "mlp.up_proj"]


def decode_steps(core: EngineCore, loras: list[LoraRequest | None], steps: int) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i, lora in enumerate(loras):
        prompt = [(7 * i + j) % 200 for j in range(PROMPT_TOKENS)]
        core.add_request(Request(f"r{time.perf_counter_ns()}-{i}", prompt, params, lora=lora))
    core.step()  # every prompt in one step (the token budget holds them)
    times = []
    while core.has_unfinished_requests():
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    return times[:-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--default-model", action="store_true", help="the embedded SmolLM2 GGUF, in its codes")
    args = parser.parse_args()
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    if args.default_model:
        config = _loaded(shape, True).config
        names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        shape = {name: int(config[name]) for name in names}
    folder = Path(tempfile.mkdtemp())
    paths = [make_mlx_lm_adapter(folder / f"a{i}", seed=i, rank=args.rank, keys=KEYS, **shape) for i in range(4)]
    base_config = dict(kv_cache_memory=1 << 27, max_num_batched_tokens=1024, block_size=16)
    if args.default_model:  # its trained context (8192) would not fit the 128 MiB pool
        base_config["max_model_len"] = 1024
    modules = tuple((f"a{i}", str(p)) for i, p in enumerate(paths))
    plain = build_engine_core(EngineConfig(**base_config), _loaded(shape, args.default_model))  # type: ignore[arg-type]
    lora_config = EngineConfig(**base_config, enable_lora=True, lora_modules=modules, max_lora_rank=args.rank)  # type: ignore[arg-type]
    lora = build_engine_core(lora_config, _loaded(shape, args.default_model))
    host = getattr(lora.runner.model.compute, "forward_on_host", None)
    print(f"adapters' deltas on: {'the one-call numba decoder' if host is not None else 'the MLX route'}")
    adapters = list(lora.lora_requests().values())
    slots = lora.runner.lora
    assert slots is not None
    print(f"one adapter's file weights: {slots.adapters['a0'].nbytes / 1e6:.2f} MB (rank {args.rank}, float32)")
    print(f"the slots ({slots.max_loras} x rank {slots.max_rank} in every linear): {slots.nbytes / 1e6:.2f} MB")
    print(f"engine weight bytes: {plain.weight_bytes / 1e6:.2f} MB without LoRA, {lora.weight_bytes / 1e6:.2f} MB with")
    variants = {
        "no --enable-lora, 8 base": (plain, [None] * 8),
        "--enable-lora, 8 base": (lora, [None] * 8),
        "--enable-lora, 8 over 4 adapters": (lora, [adapters[i % 4] for i in range(8)]),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (core, loras) in variants.items():
            results[name] += decode_steps(core, loras, args.steps)
    base = statistics.median(results["--enable-lora, 8 base"])
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:36s} median decode step {median * 1e3:7.2f} ms  ({median / base:.2f}x the 8 base requests)")


def _loaded(shape: dict[str, int], default_model: bool):  # noqa: ANN202
    if default_model:
        from metalserve.loader import load_model
        from metalserve.loader.embedded import default_model_path

        return load_model(str(default_model_path()))
    loaded = loaded_of("llama")
    from tests.models.archs import build

    loaded.model = build("llama", **shape)
    return loaded


if __name__ == "__main__":
    main()
