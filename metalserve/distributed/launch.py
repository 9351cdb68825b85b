"""Starting the ranks: join a group mlx.launch made (across Macs), or start local ranks ourselves.

`mlx.launch --backend ring` gives each process MLX_RANK and MLX_HOSTFILE (a JSON list of each rank's
`ip:port`s); on one machine `--pipeline-parallel-size N` writes such a file itself and starts ranks
1..N-1 as `python -m metalserve.serving.pipeline`, with the engine config in the environment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import mlx.core as mx

from metalserve.config import ConfigError, EngineConfig

logger = logging.getLogger("metalserve.distributed")

CONFIG_ENV = "METALSERVE_PIPELINE_CONFIG"


def launched_externally() -> bool:
    """True when mlx.launch (or a user) set the rank: every rank runs `metalserve serve` itself."""
    return "MLX_RANK" in os.environ


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def write_local_hostfile(n: int) -> str:
    """A ring hostfile for `n` ranks on this machine: one loopback port each."""
    hosts = [[f"127.0.0.1:{port}"] for port in _free_ports(n)]
    fd, path = tempfile.mkstemp(prefix="metalserve-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(hosts, f)
    return path


def config_to_env(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_env() -> EngineConfig:
    raw: dict[str, Any] = json.loads(os.environ[CONFIG_ENV])
    if raw.get("pipeline_layer_partition") is not None:
        raw["pipeline_layer_partition"] = tuple(raw["pipeline_layer_partition"])
    return EngineConfig(**raw)


def spawn_local_ranks(config: EngineConfig) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..N-1 here and make this process rank 0 of the same ring (N: every pipeline stage's
    tensor-parallel ranks)."""
    n = config.world_size
    hostfile = write_local_hostfile(n)
    os.environ["MLX_HOSTFILE"] = hostfile
    os.environ["MLX_RANK"] = "0"
    children = []
    for rank in range(1, n):
        env = {**os.environ, "MLX_RANK": str(rank), CONFIG_ENV: config_to_env(config)}
        cmd = [sys.executable, "-m", "metalserve.serving.pipeline"]
        children.append(subprocess.Popen(cmd, env=env))
    logger.info("started %d local rank(s) over the ring backend (hostfile %s)", n - 1, hostfile)
    return children


def init_group(size: int, flag: str = "--pipeline-parallel-size") -> mx.distributed.Group:
    """Join the ring; the group must have exactly `size` ranks (what `flag` asked for)."""
    if not mx.distributed.is_available():
        raise ConfigError(f"{flag}: this MLX build has no distributed backend")
    # mlx.launch --backend jaccl (Thunderbolt RDMA) names the devices; otherwise the ring (TCP) backend.
    backend = "jaccl" if "MLX_IBV_DEVICES" in os.environ else "ring"
    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() != size:
        raise ConfigError(
            f"{flag} {size}, but the launcher started {group.size()} rank(s): give the same "
            "number to both (or drop mlx.launch to start local ranks)"
        )
    return group
