"""Pipeline and tensor parallelism over MLX's distributed engine (`--pipeline-parallel-size N`,
`--tensor-parallel-size N`).

Rank 0 owns the API, the scheduler and the KV manager; every rank holds a contiguous slice of layers and
the KV pools of those layers under the same block ids. See launch.py (ranks), wire.py (messages),
stage.py (a rank's layers), rank0.py (the rank-0 runner), worker.py (ranks 1..N-1) and core.py.
Under tensor parallelism every rank holds every layer's share of heads and columns (shard.py) and runs
every step, which rank 0 broadcasts (tensor.py).
"""
