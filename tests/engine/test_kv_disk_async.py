"""The disk tier under async scheduling (step k+1 scheduled while step k computes): saves are read out
after the forward that computed their blocks, loads are in the pool before any step reads them, and
blocks completed by a token that was still being sampled when their step was scheduled are saved too.
Async scheduling is off by default on the CPU backend, so every core here turns it on explicitly."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from metalserve.engine.core import EngineCore
from metalserve.kvcache.connector.disk_store import SUFFIX, DiskStore
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from tests.engine.test_kv_disk import PROMPT, expected, generate, make_core
from tests.executor.test_runner_golden import prompts_of


def async_core(directory: Path, blocks: int = 64) -> EngineCore:
    core = make_core(directory, blocks=blocks, async_scheduling=True)
    assert core.async_scheduling and core.scheduler.lookahead
    return core


def disk_hits(core: EngineCore) -> int:
    stats = core.make_stats().connector
    assert stats is not None
    return stats.hits


def test_async_scheduling_stays_on_with_the_disk_tier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        core = async_core(tmp_path)
    assert "async scheduling: on" in caplog.text
    core.close()


def test_decoded_blocks_are_saved_and_a_restart_serves_the_next_turn_from_disk(tmp_path: Path) -> None:
    """Every decode token of a lookahead step is a placeholder when the step is scheduled, so the block
    it completes cannot be keyed then: it is saved with the next step. The next turn (the answer in its
    prompt) then loads the decoded blocks too."""
    want = expected([PROMPT], 16)
    first = async_core(tmp_path)
    assert generate(first, [PROMPT], 16) == want
    assert first.scheduler.num_placeholders >= 14
    first.close()
    # 40 prompt + 15 decoded tokens computed: 6 full blocks, block 5 (tokens 40-47) completed in decoding.
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 6

    turn2 = PROMPT + want[0][:12] + [5, 6, 7, 8]  # 56 tokens (the context is 64): 6 loadable blocks
    second = async_core(tmp_path)
    assert generate(second, [turn2], 8) == expected([turn2], 8)
    assert disk_hits(second) == 48
    second.close()


def test_ram_eviction_and_disk_hits_under_async_scheduling(tmp_path: Path) -> None:
    """A pool too small for two conversations, alternating: the returning one loads from disk while
    async scheduling runs its steps; the tokens are the cold run's."""
    a, b = prompts_of([40, 56], 97, seed=12)
    want = expected([a, b], 8)
    core = async_core(tmp_path, blocks=12)
    for _ in range(2):
        assert generate(core, [a], 8) == want[:1]
        assert generate(core, [b], 8) == want[1:]
    assert disk_hits(core) >= 16 and core.scheduler.kv.pool.num_evictions > 0
    core.close()


def test_slow_loads_finish_before_the_step_that_reads_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads that take several steps while other requests decode under async scheduling: each request
    that loads joins the batch only once its blocks are in the pool (the tokens say so)."""
    prompts = prompts_of([40, 33, 12, 47], 97, seed=21)
    want = expected(prompts, 8)
    first = async_core(tmp_path)
    assert generate(first, prompts[:2], 8) == want[:2]
    first.close()

    read = DiskStore.read

    def slow_read(self: DiskStore, key: str) -> object:
        time.sleep(0.05)  # a slow disk: a load spans several engine steps
        return read(self, key)

    monkeypatch.setattr(DiskStore, "read", slow_read)
    second = async_core(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        second.add_request(Request(f"r{i}", prompt, params))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    overlapped = 0  # steps that left a step in flight while requests were still loading
    while second.has_unfinished_requests():
        for out in second.step():
            got[out.request_id] += out.new_token_ids
        overlapped += second._in_flight is not None and second.scheduler.num_waiting_for_kv > 0
    # The new requests 2 and 3 ran (prefill, then decode) while 0 and 1 loaded from disk.
    assert overlapped >= 2
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    assert disk_hits(second) == 32 + 32
    second.close()


def test_a_hybrid_models_snapshot_reached_while_decoding_is_saved_under_async_scheduling(tmp_path: Path) -> None:
    """A recurrent-state snapshot at a block boundary that a placeholder token reached: its block is
    keyed one step late, and its state (the state that next step reads, not writes) is saved then."""
    from tests.engine import test_kv_disk_hybrid as hybrid
    from tests.models import golden

    cold = golden.serve(hybrid.make_core(None), [hybrid.PROMPT], hybrid.N)[0].tokens
    first = hybrid.make_core(tmp_path, async_scheduling=True)
    assert first.async_scheduling
    assert golden.serve(first, [hybrid.PROMPT], hybrid.N)[0].tokens == cold
    first.close()
    # 52 computed tokens: 3 full blocks of KV, and the snapshots at 16, 32 (prefill chunks) and 48 (decoding).
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 6

    turn2 = hybrid.PROMPT + cold + [5, 6, 7, 8]  # 57 tokens: the prefix up to the snapshot at 48 loads
    want = golden.serve(hybrid.make_core(None), [turn2], 4)[0].tokens
    second = hybrid.make_core(tmp_path, async_scheduling=True)
    got = golden.serve(second, [turn2], 4)[0]
    assert disk_hits(second) == got.cached_tokens == 48
    assert got.tokens == want
    second.close()
