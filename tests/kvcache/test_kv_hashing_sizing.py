"""The hash chain, the sizing function and the no-MLX rule."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from metalserve.config import ConfigError
from metalserve.kvcache.hashing import BlockHash, block_extra_keys, hash_block_tokens
from metalserve.kvcache.plan import blocks_for_request, num_blocks_for_budget
from metalserve.kvcache.specs import KVCacheSpec, RecurrentState


def test_hash_is_sha256_and_stable() -> None:
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h) == hashlib.sha256().digest_size
    assert h == hash_block_tokens(None, [1, 2, 3, 4])
    assert h != hash_block_tokens(None, [1, 2, 3, 5])


def test_hash_covers_parent_and_extra_keys() -> None:
    tokens = [5, 6, 7, 8]
    p1 = hash_block_tokens(None, [1, 2, 3, 4])
    p2 = hash_block_tokens(None, [1, 2, 3, 9])
    assert hash_block_tokens(p1, tokens) != hash_block_tokens(p2, tokens)
    assert hash_block_tokens(None, tokens, ("salt", "a")) != hash_block_tokens(None, tokens, ("salt", "b"))
    # Length-prefixed keys: splitting a string differently gives a different hash.
    assert hash_block_tokens(None, tokens, ("ab", "c")) != hash_block_tokens(None, tokens, ("a", "bc"))
    assert hash_block_tokens(None, tokens, (1,)) != hash_block_tokens(None, tokens, ("1",))


def test_hash_rejects_odd_keys() -> None:
    with pytest.raises(TypeError, match="str, int or bytes"):
        hash_block_tokens(None, [1], (1.5,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        hash_block_tokens(None, [1], (True,))


def test_extra_keys_put_salt_and_adapter_in_first_block_only() -> None:
    assert block_extra_keys(0, "s", "lora-1") == ("salt", "s", "adapter", "lora-1")
    assert block_extra_keys(1, "s", "lora-1") == ()
    assert block_extra_keys(2, None, None, (b"img",)) == ("mm", b"img")
    assert isinstance(hash_block_tokens(BlockHash(b"p"), [1], block_extra_keys(0, "s")), bytes)


def smol(block_size: int = 16, state_bytes: int = 0, layers: int = 30, heads: int = 3, dim: int = 64) -> KVCacheSpec:
    """SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64) in fp16, optionally with a state group."""
    spec = KVCacheSpec.uniform(layers, heads, dim, "float16", 2, block_size)
    if state_bytes:
        spec = KVCacheSpec(
            (*spec.groups, RecurrentState(layers=(layers,), state_bytes=state_bytes)), spec.tensors, block_size
        )
    return spec


def test_bytes_per_block() -> None:
    assert smol().bytes_per_block == 2 * 30 * 3 * 64 * 2 * 16  # K and V of every layer, 16 tokens


def test_num_blocks_for_budget() -> None:
    per_block = smol(layers=2, heads=2, dim=8).bytes_per_block  # 2048 bytes
    assert per_block == 2048
    assert num_blocks_for_budget(per_block * 100 + 5, per_block, 16, 1024) == 100
    # 1024 tokens = 64 blocks, plus the null block.
    assert num_blocks_for_budget(per_block * 65, per_block, 16, 1024) == 65
    with pytest.raises(ValueError, match="at least one byte"):
        num_blocks_for_budget(100, 0, 16, 1024)


def test_a_hybrid_block_also_counts_its_state_slot_and_a_request_two_state_entries() -> None:
    spec = smol(layers=2, heads=2, dim=8, state_bytes=1000)
    per_block = spec.bytes_per_block
    assert per_block == 2048 + 1000
    per_request = blocks_for_request(spec.groups, 1024, 16)
    assert per_request == 64 + 2
    assert num_blocks_for_budget(per_block * 67, per_block, 16, 1024, per_request) == 67
    with pytest.raises(ConfigError, match="needs 67 blocks"):
        num_blocks_for_budget(per_block * 66, per_block, 16, 1024, per_request)


def test_budget_too_small_names_missing_memory_and_flags() -> None:
    per_block = smol(layers=2, heads=2, dim=8).bytes_per_block
    with pytest.raises(ConfigError) as err:
        num_blocks_for_budget(per_block * 64, per_block, 16, 1024)
    msg = str(err.value)
    assert "2.0 KiB missing" in msg
    for flag in ("--kv-cache-memory", "--gpu-memory-utilization", "--max-model-len"):
        assert flag in msg


def test_no_module_under_kvcache_or_scheduler_imports_mlx() -> None:
    root = Path(__file__).resolve().parents[2]
    modules = [
        "metalserve." + ".".join(p.relative_to(root / "metalserve").with_suffix("").parts)
        for sub in ("kvcache", "scheduler")
        for p in sorted((root / "metalserve" / sub).glob("*.py"))
    ]
    assert "metalserve.scheduler.scheduler" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_mlx_import_statement_in_kvcache_or_scheduler() -> None:
    import ast

    root = Path(__file__).resolve().parents[2] / "metalserve"
    for path in [*(root / "kvcache").glob("*.py"), *(root / "scheduler").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "mlx" or n.startswith("mlx.") for n in names), path


def test_memory_readers_and_the_pool_cap() -> None:
    from metalserve.kvcache.plan import memory_limit, pool_block_cap
    from metalserve.serving.memory import parse_meminfo, parse_vm_stat

    assert parse_meminfo("MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n") == 12000000 * 1024
    assert parse_meminfo("MemTotal: 1 kB\n") is None
    vm_stat = (
        "Mach Virtual Memory Statistics: (page size of 16384 bytes)\nPages free:  1000.\n"
        "Pages active:  5000.\nPages inactive:  2000.\nPages speculative:  300.\nPages purgeable:  100.\n"
    )
    assert parse_vm_stat(vm_stat) == (1000 + 2000 + 300 + 100) * 16384
    gib = 1 << 30
    assert memory_limit(0.5, 24 * gib, 20 * gib, gib) == (12 * gib, "50% of 24.0 GiB")
    limit, why = memory_limit(0.5, 24 * gib, 4 * gib, gib)  # another program holds most of the memory
    assert limit == 5 * gib and "available" in why
    assert memory_limit(0.5, 24 * gib, None, gib)[0] == 12 * gib
    assert pool_block_cap(max_num_seqs=4, max_model_len=100, block_size=16) == 4 * 7 + 1


def test_sizing_over_layer_groups_sharing_the_pool() -> None:
    from metalserve.kvcache.plan import blocks_for_request, pool_block_cap
    from metalserve.kvcache.specs import FullAttention, RecurrentState, SlidingWindow

    groups = [FullAttention(layers=(1, 3)), SlidingWindow(16, layers=(0, 2))]
    assert blocks_for_request(groups, 100, 16) == 2 * 7  # a chunk may span the whole prompt in both
    assert blocks_for_request([FullAttention(), RecurrentState()], 100, 16) == 7 + 2
    per_block = 1000  # one group's layers (KVCacheSpec.bytes_per_block)
    assert num_blocks_for_budget(per_block * 200, per_block, 16, 1024, 2 * 64) == 200
    with pytest.raises(ConfigError, match="129 blocks"):
        num_blocks_for_budget(per_block * 128, per_block, 16, 1024, 128)
    assert pool_block_cap(max_num_seqs=4, max_model_len=100, block_size=16, blocks_per_request=14) == 4 * 14 + 1
