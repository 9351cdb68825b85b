"""The default model on its CPU path (the host forward verifies the windows): an edit answer is the
same text with speculation on and off, most drafts are accepted, and it takes fewer steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalserve.config import EngineConfig
from metalserve.generate import encode_chat, generate_config
from metalserve.loader import load_model
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from metalserve.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_an_edit_is_the_same_text_in_fewer_steps() -> None:
    loaded = load_model(None)
    code = (ROOT / "metalserve/scheduler/stop.py").read_text().split('"""', 2)[2].strip()
    prompt = encode_chat(loaded, f"Repeat this code exactly:\n```python\n{code}\n```")
    spec = SpeculativeConfig("ngram", 4, 2, 4)
    base = EngineConfig(max_num_batched_tokens=512, enable_prefix_caching=False, speculative_config=spec)
    core = build_engine_core(generate_config(loaded, 2, base), loaded)
    proposer = core.runner.proposer
    params = SamplingParams(temperature=0, max_tokens=96)
    results = {}
    for arm in ("off", "on"):
        core.runner.proposer = proposer if arm == "on" else None  # the same engine, with and without drafts
        core.add_request(Request(arm, prompt, params, eos_token_ids=loaded.eos_token_ids))
        tokens: list[int] = []
        steps = 0
        while core.has_unfinished_requests():
            tokens += [t for out in core.step() for t in out.new_token_ids]
            steps += 1
        results[arm] = (tokens, steps)
    assert results["on"][0] == results["off"][0] and len(results["on"][0]) > 48
    stats = core.make_stats()
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens
    assert results["on"][1] < 0.6 * results["off"][1]
