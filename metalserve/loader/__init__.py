"""metalserve.loader."""
