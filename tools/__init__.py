"""Developer tools: the MSL emulator and Mac scripts (not part of the metalserve package)."""
