#!/usr/bin/env bash
# Run on an Apple-silicon Mac (nothing in this project's CI can run Metal). From the repository root:
#   tools/mac_kernel_check.sh
# 1. the kernel tests, whose metal_tiled / metal_decode rows run on the GPU here instead of skipping;
# 2. records both kernels' outputs for every test case (tests/kernels/data/metal_outputs.npz: commit it,
#    and the emulator is then checked against real GPU output on every machine) and checks them;
# 3. records which tiled-kernel threadgroups this GPU accepts (tests/kernels/data/mac_tiles.json: commit
#    it; the tiles the server plans must all be accepted, else it falls back to smaller tiles or MLX ops);
# 4. times the kernels against mx.fast.scaled_dot_product_attention on a gathered copy of the KV
#    (prefill 512 / 4K / 16K, decode batch 1 / 8 / 32 at 1K / 8K / 32K) and prints the traffic model.
# Output goes to the terminal and to mac_kernel_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
make .venv/.installed
PY=.venv/bin/python
{
  "$PY" -c "import mlx.core as mx; assert mx.metal.is_available(), 'no Metal device'; print(mx.metal.device_info())"
  "$PY" -m pytest tests/kernels -q -m "not slow" -rs
  "$PY" tools/record_metal_outputs.py
  "$PY" -m pytest tests/kernels/test_metal_recording.py -q -rs
  "$PY" tools/record_tile_acceptance.py
  "$PY" bench/kernel_attention.py --shapes all
  "$PY" bench/kernel_traffic.py
} 2>&1 | tee mac_kernel_check.log
