"""One lock for every parallel numba kernel: numba's workqueue threading layer must not be entered
from two threads at once.

The workqueue layer is chosen here, before any parallel kernel runs: with the MKL wheel installed,
numba would pick Intel OpenMP instead, and its busy-waiting teams made the server's in-order decode
~10-20x slower on 2 cores (48 tokens: 27-48 s with OpenMP, 1.8-2.2 s with workqueue; notes of issue 26).
"""

from __future__ import annotations

import os
import threading

import numba

if "NUMBA_THREADING_LAYER" not in os.environ:  # an explicit choice wins
    numba.config.THREADING_LAYER = "workqueue"  # type: ignore[attr-defined]

launch_lock = threading.Lock()
