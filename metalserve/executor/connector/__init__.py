"""The KV connector seam's worker half: it moves block pages between the pools and a store, on the
engine thread (which owns the MLX arrays), around each forward. The scheduler half is in
metalserve/kvcache/connector/."""
