"""Grammar-constrained decoding (llguidance): specs, a compile cache, matchers and batched token masks."""
