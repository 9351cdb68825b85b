"""metalserve.executor."""
