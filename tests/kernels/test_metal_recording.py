"""The emulator against outputs recorded on a real Metal GPU (tools/record_metal_outputs.py).

Skipped until someone records the file on a Mac and commits it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.kernels.cases import CASES, TOLERANCE, Case, as_f64, make_inputs
from tools.msl_emulator.emulated import emulated_paged_attention

RECORDING = Path(__file__).parent / "data" / "metal_outputs.npz"


PAIRS = [(c, k) for c in CASES for k in c.kernels]


@pytest.mark.parametrize(("case", "kernel"), PAIRS, ids=[f"{c.name}-{k}" for c, k in PAIRS])
def test_emulator_matches_recorded_metal(case: Case, kernel: str) -> None:
    if not RECORDING.exists():
        pytest.skip(f"{RECORDING.name} not recorded yet (run tools/record_metal_outputs.py on a Mac)")
    recorded = np.load(RECORDING)
    key = f"{case.name}/{kernel}"  # tools/record_metal_outputs.py's recording_key
    if key not in recorded:
        pytest.skip(f"{RECORDING.name} has no {key!r}: record it again with tools/record_metal_outputs.py")
    x = make_inputs(case)
    got = emulated_paged_attention(
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
        partition_size=None if kernel == "tiled" else case.partition_size,
        kernel=kernel,
    )
    np.testing.assert_allclose(as_f64(got), recorded[key], atol=TOLERANCE[case.dtype], rtol=0)
