"""Host compute for MLX's CPU backend: NumPy/numba twins of the decoder, projections, MLP and head.

`choose_compute` picks the strategy once from the Platform; nothing else in the executor tests the device.
"""

from __future__ import annotations

from collections.abc import Mapping

from metalserve.executor.models.compute import MlxCompute, ModelCompute
from metalserve.kernels.affine_codes import AffineCodes
from metalserve.platform import Platform


def choose_compute(platform: Platform, codes: Mapping[str, AffineCodes]) -> ModelCompute:
    """Host compute where MLX runs on the CPU and numba is installed, else everything in MLX.

    `codes`: the stored codes the loader kept, by module path (see LoadedModel.codes)."""
    if not platform.host_compute:
        return MlxCompute()
    from metalserve.executor.host.compute import HostCompute

    return HostCompute(codes)
