"""Host compute for MLX's CPU backend: NumPy/numba twins of the decoder, projections, MLP and head.

`choose_compute` picks the strategy once from the Platform; nothing else in the executor tests the device.
"""

from __future__ import annotations

from collections.abc import Mapping

from metalserve.executor.models.compute import MlxCompute, ModelCompute
from metalserve.kernels.cpu.affine_codes import AffineCodes
from metalserve.platform import Platform

# The dense llama-family models whose blocks the host twins reproduce; every other family runs mlx-lm's
# own modules (attention through the selected backend) on MLX.
HOST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def choose_compute(platform: Platform, codes: Mapping[str, AffineCodes], model_type: str) -> ModelCompute:
    """Host compute where MLX runs on the CPU, numba is installed and the model is of the llama family,
    else everything in MLX.

    `codes`: the stored codes the loader kept, by module path (see LoadedModel.codes)."""
    if not platform.host_compute or model_type not in HOST_MODEL_TYPES:
        return MlxCompute()
    from metalserve.executor.host.compute import HostCompute

    return HostCompute(codes)
