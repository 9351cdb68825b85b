"""Where a decode step goes on the CPU fast path: each projection, the head, and the rest.

    PYTHONPATH=$PWD NUMBA_NUM_THREADS=1 .venv/bin/python bench/cpu_decode_profile.py [--model GGUF] \
        [--context 256] [--steps 30] [--requests 1] [--cpu-int8-activations on]

Loads the model as the server does (weights in their codes), runs a decode step of `--requests` requests
(8: the c=8 workload's steps) at `--context` through the paged runner (median of `--steps`), then times
each projection of every layer alone on that many rows (`packed_linear`, the kernel the host decoder
calls) and the head. Printed: ms a step per part, its share
of the step, and the bytes each part reads a step with the rate that implies. "rest" is the step less
the projections and the head: attention, norms, RoPE, sampling and the runner's Python.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

# isort: off
import metalserve  # noqa: F401  (before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
import numpy as np

from metalserve.kernels.cpu.packed_linear import Segments, packed_linear


def _median_ms(call: Callable[[], object], repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _segment_bytes(seg: Segments, layer: int) -> int:
    first, last = seg.layer_first[layer], seg.layer_first[layer + 1]
    return sum(seg.data[s].nbytes + seg.scales[s].nbytes + seg.biases[s].nbytes for s in range(first, last))


def _step_ms(loaded: object, context: int, steps: int, requests: int = 1) -> tuple[float, object]:
    from metalserve.executor.attention.cpu import CpuAttention
    from metalserve.executor.host import paged_model
    from metalserve.executor.runner import ModelRunner
    from metalserve.executor.sampler import Sampler
    from metalserve.platform import current_platform
    from metalserve.sampling_params import SamplingParams
    from metalserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

    paged = paged_model(loaded, current_platform())  # type: ignore[arg-type]
    per_request = -(-(context + steps + 16) // 16) + 4
    spec = paged.get_kv_cache_spec(paged.family.page(loaded.model), 16, per_request * requests)  # type: ignore[attr-defined]
    runner = ModelRunner(paged, spec, eos_token_ids=frozenset(), sampler=Sampler(0), backend=CpuAttention())
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    ids = [f"d{k}" for k in range(requests)]
    for k, rid in enumerate(ids):  # each request's prompt prefilled on its own
        prompt = np.random.default_rng(k).integers(0, 20000, context).tolist()
        table = list(range(k * per_request, (k + 1) * per_request))
        new = NewRequestData(rid, prompt, context, params, (table,), 0)
        runner.execute_model(SchedulerOutput([new], [], {rid: context}, context))
    computed, times = context, []
    for i in range(steps + 2):
        cached = [CachedRequestData(rid, ([],), computed) for rid in ids]
        start = time.perf_counter()
        runner.execute_model(SchedulerOutput([], cached, dict.fromkeys(ids, 1), requests))
        if i >= 2:
            times.append(time.perf_counter() - start)
        computed += 1
    return 1000 * statistics.median(times), paged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded default model)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--requests", type=int, default=1, help="decode rows a step (8: the c=8 workload's steps)")
    ap.add_argument("--cpu-int8-activations", default="off", choices=("auto", "on", "off"))
    args = ap.parse_args()
    from metalserve.kernels.cpu import int8_dot
    from metalserve.loader import load_model

    int8_dot.set_mode(args.cpu_int8_activations)

    loaded = load_model(args.model)
    step, paged = _step_ms(loaded, args.context, args.steps, args.requests)
    rows = args.requests
    compute = paged.compute  # type: ignore[attr-defined]
    host = compute.forward_on_host
    if host is None:
        raise SystemExit(f"{loaded.weights_desc}: not on the host fast path")
    weights = host.weights
    layers = weights.input_norm.shape[0]
    parts: dict[str, tuple[float, int]] = {}
    for name in ("qkv", "o", "gate_up", "down"):
        seg: Segments = getattr(weights, name)
        ms, nbytes = 0.0, 0
        for layer in range(layers):
            x = np.random.default_rng(layer).standard_normal((rows, seg.columns)).astype(np.float32)
            ms += _median_ms(lambda: packed_linear(x, seg, layer), 5)  # noqa: B023  (called at once)
            nbytes += _segment_bytes(seg, layer)
        parts[name] = (ms, nbytes)
    if compute.head_codes is not None:
        head = compute.head_codes.segments()
        x = np.random.default_rng(0).standard_normal((rows, head.columns)).astype(np.float32)
        parts["head"] = (_median_ms(lambda: packed_linear(x, head), 7), _segment_bytes(head, 0))
    known = sum(ms for ms, _ in parts.values())
    print(
        f"{loaded.weights_desc}; {layers} layers; {rows} request(s) at context {args.context}; "
        f"decode step {step:.1f} ms (median)"
    )
    print(f"{'part':10}{'ms':>9}{'share':>8}{'MB read':>10}{'GB/s':>8}")
    for name, (ms, nbytes) in parts.items():
        print(f"{name:10}{ms:9.2f}{ms / step:8.0%}{nbytes / 1e6:10.1f}{nbytes / 1e6 / ms:8.2f}")
    print(f"{'rest':10}{step - known:9.2f}{(step - known) / step:8.0%}")


if __name__ == "__main__":
    main()
