"""The V1 token-budget scheduler (no MLX imports)."""
