"""metalserve.kernels: metal/ (MSL sources, launch builders, tiling, traffic model) and cpu/ (numba)."""
