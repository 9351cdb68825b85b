"""metalserve.engine."""
