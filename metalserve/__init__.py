"""metalserve: a vLLM-V1-style inference server on MLX."""

# Before anything imports MLX: give its CPU backend an optimized BLAS (see metalserve/blas.py).
try:
    from metalserve.blas import preload_blas as _preload_blas

    _preload_blas()
except Exception:  # noqa: BLE001 - a faster BLAS is an optimisation; never fail the import over it
    pass

# Before anything imports numba: its kernel cache in a folder of this version's own (see numba_cache.py).
try:
    from metalserve.numba_cache import set_numba_cache_dir as _set_numba_cache_dir

    _set_numba_cache_dir()
except OSError:  # an unreadable home or source folder: numba's default cache beside the sources
    pass

__version__ = "0.1.0"
