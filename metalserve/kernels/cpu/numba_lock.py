"""One lock for every parallel numba kernel: numba's default (workqueue) threading layer must not be
entered from two threads at once."""

from __future__ import annotations

import threading

launch_lock = threading.Lock()
