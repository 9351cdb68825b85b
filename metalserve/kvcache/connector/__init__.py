"""The KV connector seam's scheduler half (after vLLM's KVConnectorBase_V1) and the disk tier behind it.

No MLX here: the scheduler half decides which blocks move; the worker half (metalserve/executor/connector/)
moves their pages on the engine thread. The disk tier: disk_scheduler.py, disk_store.py and disk_keys.py
here, disk_worker.py there (docs/disk-tier.md lists every piece)."""
