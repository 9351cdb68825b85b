"""The BLAS preload, checked in fresh interpreters (it only works before MLX is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from metalserve.blas import find_mkl

_PROBE = """
import json, metalserve
import mlx.core as mx
import numpy as np
from metalserve.blas import blas_description
a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((200, 100)).astype(np.float32)
c = np.array(mx.array(a) @ mx.array(b))
err = float(np.abs(c - a.astype(np.float64) @ b.astype(np.float64)).max())
maps = open("/proc/self/maps").read()
import os
threads = os.environ.get("OPENBLAS_NUM_THREADS")
print(json.dumps({"desc": blas_description(), "mkl_mapped": "libmkl_rt" in maps, "err": err, "openblas": threads}))
"""


def _probe(env_extra: dict[str, str], pre: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"} | env_extra
    out = subprocess.run(
        [sys.executable, "-c", pre + _PROBE], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_mkl = pytest.mark.skipif(
    not sys.platform.startswith("linux") or find_mkl() is None, reason="the mkl wheel is for x86_64 Linux"
)


@needs_mkl
def test_importing_metalserve_loads_mkl_and_matmul_stays_right() -> None:
    result = _probe({})
    assert result["desc"].startswith("mkl (") and result["mkl_mapped"]
    assert result["err"] < 1e-3


@needs_mkl
def test_env_var_turns_it_off() -> None:
    result = _probe({"METALSERVE_BLAS": "none"})
    assert result["desc"] == "bundled reference BLAS (METALSERVE_BLAS=none)" and not result["mkl_mapped"]
    assert result["err"] < 1e-3


@needs_mkl
def test_too_late_when_mlx_came_first() -> None:
    result = _probe({}, pre="import mlx.core\n")
    assert "mlx was imported before metalserve" in result["desc"] and not result["mkl_mapped"]


@needs_mkl
def test_numpys_openblas_gets_one_thread_unless_the_user_chose() -> None:
    assert _probe({})["openblas"] == "1"
    assert _probe({"OPENBLAS_NUM_THREADS": "2"})["openblas"] == "2"
    assert _probe({"METALSERVE_BLAS": "none"})["openblas"] is None
