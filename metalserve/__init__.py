"""metalserve: a vLLM-V1-style inference server on MLX."""

# Before anything imports MLX: give its CPU backend an optimized BLAS (see metalserve/blas.py).
try:
    from metalserve.blas import preload_blas as _preload_blas

    _preload_blas()
except Exception:  # noqa: BLE001 - a faster BLAS is an optimisation; never fail the import over it
    pass

__version__ = "0.1.0"
