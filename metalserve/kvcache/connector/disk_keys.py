"""Store keys: a block's chain hash together with everything that changes its bytes."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True)
class StoreNamespace:
    """What besides the tokens decides a block's pages: the model (weights and layout), the layer group,
    the storage dtype of the KV spec ("auto": the model's own), and the block size. The cache salt is
    part of each key too (it is also in the chain hash's first block), so tenants never share a file."""

    model_fingerprint: str
    layer_group: int = 0
    storage_dtype: str = "auto"
    block_size: int = 16

    def key(self, chain_hash: bytes, cache_salt: str | None = None) -> str:
        """64 hex digits, the file's name in the store."""
        salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8", "surrogatepass")
        parts = [
            b"metalserve-kv-disk-v1",
            self.model_fingerprint.encode(),
            struct.pack("<iI", self.layer_group, self.block_size),
            self.storage_dtype.encode(),
            salt,
            bytes(chain_hash),
        ]
        return hashlib.sha256(b"".join(_field(p) for p in parts)).hexdigest()
