"""metalserve.executor.models."""
