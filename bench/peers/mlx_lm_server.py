"""Run `mlx_lm.server` with the same optimized BLAS metalserve uses (MKL loaded before MLX).

Without it, mlx-lm on Linux runs on the reference BLAS bundled in the mlx-cpu wheel and the comparison
would be of BLAS libraries, not of servers. All arguments go to mlx_lm.server, e.g.
    .venv/bin/python bench/peers/mlx_lm_server.py --model /work/peers/smollm2-fp32-mlx --port 8081
"""

from __future__ import annotations

import sys

from metalserve.blas import preload_blas


def main() -> None:
    print(f"mlx_lm.server with BLAS: {preload_blas()}", file=sys.stderr, flush=True)
    from mlx_lm.server import main as server_main  # only after the BLAS is loaded

    sys.argv[0] = "mlx_lm.server"
    server_main()


if __name__ == "__main__":
    main()
