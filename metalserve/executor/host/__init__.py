"""Host compute for MLX's CPU backend: NumPy/numba twins of the decoder, projections, MLP and head.

`choose_compute` picks the strategy once from the Platform; nothing else in the executor tests the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from metalserve.executor.models.compute import MlxCompute
from metalserve.executor.models.families import model_family
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.platform import Platform

if TYPE_CHECKING:
    from metalserve.executor.models.adapter import ModelCompute


def choose_compute(platform: Platform, codes: Mapping[str, PackedCodes], model_type: str) -> ModelCompute:
    """Host compute where MLX runs on the CPU, numba is installed and the family may take the host path
    (families.py: the dense llama family), else everything in MLX.

    `codes`: the stored codes the loader kept, by module path (see LoadedModel.codes)."""
    if not platform.host_compute or not model_family(model_type).host_path:
        return MlxCompute()
    from metalserve.executor.host.compute import HostCompute

    return HostCompute(codes)
