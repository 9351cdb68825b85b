"""The KV connector seam's worker half: it moves block pages between the pools and a store, on the
engine thread (which owns the MLX arrays), around each forward. The scheduler half is in
metalserve/kvcache/connector/. The disk tier's worker half is disk_worker.py (its scheduler half:
kvcache/connector/disk_scheduler.py)."""
