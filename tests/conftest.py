"""Import metalserve before anything imports MLX, so the optimized BLAS is loaded first."""

import metalserve  # noqa: F401
