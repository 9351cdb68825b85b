"""metalserve.api.tool_parsers."""
