"""Make MLX's CPU backend use an optimized BLAS by loading one before MLX is imported.

The Linux mlx-cpu wheel links the netlib reference BLAS (a few GFLOP/s). MKL's `libmkl_rt`, loaded
with RTLD_GLOBAL first, provides the same `cblas_*` symbols and wins symbol resolution for MLX.
This module must not import MLX.
"""

from __future__ import annotations

import ctypes
import os
import site
import sys
from pathlib import Path

ENV_VAR = "METALSERVE_BLAS"  # "none": keep MLX's bundled BLAS
_MKL_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")

_description: str | None = None


def _candidate_dirs() -> list[Path]:
    """Where pip puts the mkl wheel's libraries: `<prefix>/lib`, next to the site-packages in use."""
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    packages = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    packages.append(site.getusersitepackages())
    for pkg in packages:
        dirs.append(Path(pkg).parents[1])  # <prefix>/lib/pythonX.Y/site-packages -> <prefix>/lib
    seen: list[Path] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def find_mkl() -> Path | None:
    """The path of MKL's single dynamic library, or None when the mkl wheel is not installed."""
    for directory in _candidate_dirs():
        for name in _MKL_NAMES:
            path = directory / name
            if path.is_file():
                return path
    return None


def _preload() -> str:
    if os.environ.get(ENV_VAR, "").strip().lower() == "none":
        return f"bundled reference BLAS ({ENV_VAR}=none)"
    if sys.platform == "darwin":
        return "Accelerate"
    if "mlx.core" in sys.modules:
        # Too late: MLX already resolved its BLAS symbols.
        return "bundled reference BLAS (mlx was imported before metalserve)"
    path = find_mkl()
    if path is None:
        return "bundled reference BLAS (the mkl package is not installed)"
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return f"bundled reference BLAS (loading {path} failed: {exc})"
    # NumPy's own OpenBLAS (the CPU path's vocabulary projection) would keep busy-waiting threads beside
    # MKL's and numba's on the same cores: consecutive decode steps ran up to 1.3x slower with them.
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    return f"mkl ({path})"


def preload_blas() -> str:
    """Load MKL globally if possible (once) and say which BLAS MLX's CPU backend will use."""
    global _description
    if _description is None:
        _description = _preload()
    return _description


def blas_description() -> str:
    """What `preload_blas` chose; calls it if nobody has yet."""
    return preload_blas()
