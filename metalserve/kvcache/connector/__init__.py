"""The KV connector seam's scheduler half (after vLLM's KVConnectorBase_V1) and the disk tier behind it.

No MLX here: the scheduler half decides which blocks move; the worker half (metalserve/executor/connector/)
moves their pages on the engine thread."""
