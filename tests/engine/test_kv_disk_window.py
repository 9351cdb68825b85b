"""The disk tier on a sliding-window model (a tiny random gemma3_text: full-attention layers 1 and 3,
window layers 0 and 2, window 16): a restart on the same directory loads the prefix of both groups, only
the window's blocks of the window group, and gives the tokens of a cold run."""

from __future__ import annotations

from pathlib import Path

from metalserve.engine.core import EngineCore
from metalserve.kvcache.connector.disk_scheduler import DiskConnectorScheduler
from metalserve.kvcache.connector.disk_store import SUFFIX
from metalserve.request import Request
from tests.models import golden
from tests.models.archs import build

BLOCK = 8
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(45)]  # 45 tokens: 5 full blocks; 44 computed leave 5 to load


def make_core(directory: Path | None) -> EngineCore:
    extra = {} if directory is None else {"kv_disk_dir": str(directory)}
    return golden.engine(build("gemma3_text"), block_size=BLOCK, max_model_len=128, **extra)


def connector(core: EngineCore) -> DiskConnectorScheduler:
    assert core.scheduler.kv_loads is not None
    c = core.scheduler.kv_loads.connector
    assert isinstance(c, DiskConnectorScheduler)
    return c


def test_a_restart_serves_a_sliding_window_model_from_disk_with_the_tokens_of_a_cold_run(tmp_path: Path) -> None:
    cold = make_core(None)
    want = golden.serve(cold, [PROMPT], 8)[0].tokens
    cold.close()

    first = make_core(tmp_path)
    assert connector(first).windows == [None, 16] or connector(first).windows == [16, None]
    assert golden.serve(first, [PROMPT], 8)[0].tokens == want
    first.close()
    # 52 computed tokens (45 + 7 decoded): 6 full blocks in each of the two groups, keyed apart.
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 12

    second = make_core(tmp_path)
    probe = Request("probe", PROMPT, golden.SamplingParams())
    second.scheduler.kv.hash_prompt(probe)
    c = connector(second)
    window_group = c.windows.index(16)
    # Blocks 0-2 of the window group lie behind the window of token 40 (it reads 25..40): not needed.
    for i in range(3):
        (tmp_path / (c.namespaces[window_group].key(probe.block_hashes[i]) + SUFFIX)).unlink()
    got = golden.serve(second, [PROMPT], 8)[0]
    stats = second.make_stats().connector
    second.close()
    assert stats is not None and stats.hits == 40  # 5 blocks of 8 tokens from disk
    assert got.cached_tokens == 40
    assert got.tokens == want
