"""Host compute for MLX's CPU backend: NumPy/numba twins of the decoder, projections, MLP and head.

`choose_compute` picks the strategy once from the Platform; nothing else in the executor tests the device.
`paged_model` builds a loaded model's `PagedModel` with it (here, above the adapter, so that the adapter
never imports the host path).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from metalserve.executor.models.adapter import ModelCompute, PagedModel
from metalserve.executor.models.compute import MlxCompute
from metalserve.executor.models.families import model_family
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.platform import Platform

if TYPE_CHECKING:
    from metalserve.loader import LoadedModel


def host_compute_applies(platform: Platform, model_type: str) -> bool:
    """Whether `choose_compute` picks the host compute for this model type on this platform."""
    return platform.host_compute and model_family(model_type).host_path


def choose_compute(platform: Platform, codes: Mapping[str, PackedCodes], model_type: str) -> ModelCompute:
    """Host compute where MLX runs on the CPU, numba is installed and the family may take the host path
    (families.py: the dense llama family), else everything in MLX.

    `codes`: the stored codes the loader kept, by module path (see LoadedModel.codes)."""
    if not host_compute_applies(platform, model_type):
        return MlxCompute()
    from metalserve.executor.host.compute import HostCompute

    return HostCompute(codes)


def paged_model(loaded: LoadedModel, platform: Platform) -> PagedModel:
    """The loaded model with the compute strategy the Platform calls for."""
    # An embedding left in its file (FileRows) is only looked up: the host compute reads the matrices.
    matrices = {path: c for path, c in loaded.codes.items() if isinstance(c, PackedCodes)}
    compute = choose_compute(platform, matrices, loaded.model_type)
    if isinstance(compute, MlxCompute):
        loaded.codes.clear()  # the loader keeps them on MLX's CPU backend; only the host path reads them
    return PagedModel(loaded.model, loaded.model_type, compute)
