"""Hash chain over full KV blocks: a block's hash covers its parent's hash, its tokens and extra keys.

The chain makes a hash name a whole prefix, not one block, so equal hashes mean equal KV contents.
The serialization is explicit (tagged, length-prefixed, little-endian) so hashes are stable across
processes and machines; sha256 makes a collision between different prefixes practically impossible.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NewType, Union

BlockHash = NewType("BlockHash", bytes)
# One extra key: a cache salt, an adapter id, a multimodal content hash, ...
ExtraKey = Union[str, int, bytes]  # noqa: UP007 (a runtime alias; `|` needs Python 3.10 types)

DEFAULT_HASH_ALGORITHM = "sha256"
_U32 = struct.Struct("<I")
_BIG_ENDIAN = sys.byteorder == "big"
if array("q").itemsize != 8:
    raise ImportError("array('q') must be 8 bytes for a stable token serialization")
_SALT_TAG = "salt"
_ADAPTER_TAG = "adapter"
_MM_TAG = "mm"


def _encode_key(key: ExtraKey) -> bytes:
    """A tagged, length-prefixed encoding, so ("a", "bc") and ("ab", "c") never serialize the same."""
    if isinstance(key, bool):
        raise TypeError("extra keys may not be bool")
    if isinstance(key, int):
        return b"i" + struct.pack("<q", key)
    if isinstance(key, str):
        try:
            data = key.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a prefix-cache key (cache_salt) holds text that is not valid Unicode") from None
        return b"s" + struct.pack("<I", len(data)) + data
    if isinstance(key, bytes):
        return b"b" + struct.pack("<I", len(key)) + key
    raise TypeError(f"extra keys must be str, int or bytes, got {type(key).__name__}")


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    data = array("q", token_ids)
    if _BIG_ENDIAN:
        data.byteswap()
    return data.tobytes()


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[ExtraKey, ...] = (),
    algorithm: str = DEFAULT_HASH_ALGORITHM,
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block of a sequence)."""
    parent_bytes = parent if parent is not None else b""
    parts = [
        _U32.pack(len(parent_bytes)),
        parent_bytes,
        _U32.pack(len(token_ids)),
        _tokens_bytes(token_ids),
        _U32.pack(len(extra_keys)),
    ]
    parts += [_encode_key(key) for key in extra_keys]
    data = b"".join(parts)
    # One buffer, one call: this runs once per block filled, in the decode loop.
    if algorithm == "sha256":
        return BlockHash(hashlib.sha256(data).digest())
    return BlockHash(hashlib.new(algorithm, data).digest())


def block_extra_keys(
    block_index: int,
    cache_salt: str | None = None,
    adapter_id: str | int | None = None,
    mm_hashes: tuple[bytes, ...] = (),
) -> tuple[ExtraKey, ...]:
    """Extra keys of block `block_index`.

    The salt and the adapter id go into the first block only: the chain carries them to every later
    block. `mm_hashes` are the content hashes of multimodal inputs whose placeholders fall in this block.
    """
    keys: list[ExtraKey] = []
    if block_index == 0 and cache_salt is not None:
        keys += [_SALT_TAG, cache_salt]
    if block_index == 0 and adapter_id is not None:
        keys += [_ADAPTER_TAG, adapter_id]
    for mm_hash in mm_hashes:
        keys += [_MM_TAG, mm_hash]
    return tuple(keys)
