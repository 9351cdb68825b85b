"""Paged KV block allocation with hash-chained prefix caching (no MLX imports)."""
