"""metalserve: a vLLM-V1-style inference server on MLX."""

__version__ = "0.1.0"
