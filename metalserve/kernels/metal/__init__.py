"""The Metal kernels: MSL sources, their launch builders (run on the GPU or the emulator), tiling, traffic model."""
