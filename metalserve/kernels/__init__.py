"""metalserve.kernels."""
