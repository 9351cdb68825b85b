"""metalserve.api."""
