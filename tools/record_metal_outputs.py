"""Run on a Mac: record both Metal kernels' outputs (tiled and decode) for the kernel test cases.

    python tools/record_metal_outputs.py [--out tests/kernels/data/metal_outputs.npz]

tests/kernels/test_metal_recording.py then checks the CPU emulator against this file on any machine,
which ties the emulator's answers to the real GPU's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from metalserve.kernels.metal.gpu import metal_paged_attention  # noqa: E402
from tests.kernels.cases import CASES, make_inputs  # noqa: E402

DEFAULT_OUT = ROOT / "tests" / "kernels" / "data" / "metal_outputs.npz"
KERNELS = ("tiled", "decode")


def recording_key(case: str, kernel: str) -> str:
    return f"{case}/{kernel}"


def record(out_path: Path) -> None:
    if not mx.metal.is_available():
        raise SystemExit("no Metal device: run this on an Apple-silicon Mac")
    results: dict[str, np.ndarray] = {}
    for case in CASES:
        x = make_inputs(case)
        for kernel in (k for k in KERNELS if k in case.kernels):
            out = metal_paged_attention(
                x.q,
                x.k_pool,
                x.v_pool,
                x.block_tables,
                x.cu_seqlens_q,
                x.seq_lens,
                block_size=case.block_size,
                scale=x.scale,
                sliding_window=case.sliding_window,
                softcap=case.softcap,
                sinks=x.sinks,
                kernel=kernel,
                partition_size=None if kernel == "tiled" else case.partition_size,
            )
            results[recording_key(case.name, kernel)] = np.array(out.astype(mx.float32))
            print(f"{case.name:20s} {kernel:7s} {case.dtype:9s} {tuple(out.shape)}")
    info = mx.metal.device_info()
    results["__device__"] = np.array(f"{info.get('device_name', '?')} mlx {getattr(mx, '__version__', '?')}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_path, **results)  # type: ignore[arg-type]
    print(f"wrote {out_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    record(parser.parse_args().out)


if __name__ == "__main__":
    main()
