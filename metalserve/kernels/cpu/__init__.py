"""The numba kernels of the CPU fast path (dense llama-family on Linux): attention, codes matmul, decoder."""
