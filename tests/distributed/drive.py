"""Drive an engine core over a fixed workload and print each request's greedy tokens (JSON).

`python -m tests.distributed.drive SPEC.json` runs the pipelined (or, with "tp", tensor-parallel) core
(rank 0 here, the other ranks started by it); `reference_tokens` runs one process on the same generic
MLX path, for comparison.
Requests arrive staggered (one every `stagger` steps) so steps mix prefill chunks and decodes, and
prompts share prefixes so later ones hit the prefix cache.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from typing import Any

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams


def workload(spec: dict[str, Any]) -> list[list[int]]:
    """Prompts of token ids: a shared prefix, then a per-request tail of varied length."""
    prefix = [(7 * i + 3) % 250 + 5 for i in range(spec["prefix_len"])]
    return [
        prefix[: spec["prefix_len"] - 3 * j] + [(11 * j + i) % 250 + 5 for i in range(4 + 5 * j)]
        for j in range(spec["num_requests"])
    ]


def run_core(core: EngineCore, prompts: list[list[int]], max_tokens: int, stagger: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or core.has_unfinished_requests():
        if pending and steps % stagger == 0:
            i, prompt = pending.pop(0)
            core.add_request(Request(f"r{i}", prompt, params))
            tokens[f"r{i}"] = []
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        if steps > 10_000:
            raise RuntimeError("the engine did not finish the workload")
    return tokens


def config_of(spec: dict[str, Any]) -> EngineConfig:
    return EngineConfig(
        model=spec["model"],
        block_size=8,
        max_num_batched_tokens=spec["budget"],
        enable_prefix_caching=True,
        kv_cache_memory=64 << 20,
        pipeline_parallel_size=spec.get("pp", 1),
        tensor_parallel_size=spec.get("tp", 1),
        attention_backend="mlx",
        pipeline_step_timeout=60.0,
        max_model_len=512,
        weights=spec.get("weights", "auto"),
    )


def reference_tokens(spec: dict[str, Any]) -> dict[str, list[int]]:
    """One process, the generic MLX path (not the numba host forward): what every pipeline rank runs."""
    from metalserve.executor.attention.mlx import MlxAttention
    from metalserve.executor.models.adapter import PagedModel
    from metalserve.executor.models.compute import MlxCompute
    from metalserve.executor.models.families import kv_cache_spec
    from metalserve.executor.runner import ModelRunner
    from metalserve.executor.sampler import Sampler
    from metalserve.loader import load_model
    from metalserve.serving.kv_groups import build_scheduler

    config = replace(config_of(spec), pipeline_parallel_size=1, tensor_parallel_size=1)
    loaded = load_model(config.model, weights=config.weights)
    model = PagedModel(loaded.model, loaded.model_type, MlxCompute())
    blocks = 512
    kv_spec = kv_cache_spec(loaded, config.block_size, num_blocks=blocks)
    runner = ModelRunner(model, kv_spec, eos_token_ids=loaded.eos_token_ids, sampler=Sampler(0), backend=MlxAttention())
    scheduler = build_scheduler(config, kv_spec, blocks, 512, None)
    core = EngineCore(scheduler, runner, 512)
    return run_core(core, workload(spec), spec["max_tokens"], spec["stagger"])


def main() -> int:
    from metalserve.serving.pipeline import start_pipeline
    from metalserve.serving.tensor import start_tensor_parallel

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    start = start_tensor_parallel if spec.get("pp", 1) == 1 and spec.get("tp", 1) > 1 else start_pipeline
    core, _, watchdog = start(config_of(spec))
    tokens = run_core(core, workload(spec), spec["max_tokens"], spec["stagger"])
    stats = core.make_stats()
    print(json.dumps({"tokens": tokens, "prefix_hits": stats.prefix_cache_hits}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
