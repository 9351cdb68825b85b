"""One lock for every parallel numba kernel: a numba threading layer must not be entered from two
threads at once (the async forward thread and the engine thread both launch kernels).

numba keeps its own choice of layer (Intel OpenMP where the MKL wheel brings it). Forcing workqueue was
tried: on a quiet 2-core machine it made batch-1 decode 2-3x slower (TPOT 44-53 ms against 14-22 ms,
bench/compare_peers.py at c=1); OpenMP's spinning teams only hurt on an oversubscribed machine.
"""

from __future__ import annotations

import threading

launch_lock = threading.Lock()
