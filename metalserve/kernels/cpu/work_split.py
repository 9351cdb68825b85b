"""How the kernels' parallel loops order their work items for numba's threads.

numba's `prange` hands each thread one contiguous run of the iteration space (a static split), so items
sorted by cost (a causal block's keys, a request's context) would give one thread all the long ones.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True, inline="always")
def short_long(k, items):  # noqa: ANN001, ANN202  (numba infers the types)
    """The item that iteration `k` of `items` takes, for items sorted short to long: 0, last, 1, last - 1,
    ...; each thread's contiguous run of iterations then holds as many long items as short ones."""
    return k // 2 if k % 2 == 0 else items - 1 - k // 2
