"""The disk tier skips a request that asks for its prompt's logprobs (as the RAM prefix cache does): its
whole prompt is computed, so every prompt token has its logprob even on a warm directory."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from metalserve.engine.core import EngineCore
from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from tests.engine.test_core import tiny_loaded
from tests.engine.test_kv_disk import PROMPT, make_core


def prompt_logprobs(core: EngineCore) -> list[EngineCoreOutput]:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    core.add_request(Request("p", list(PROMPT), params))
    outs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outs += core.step()
    return outs


def test_prompt_logprobs_on_a_warm_directory_cover_the_whole_prompt(tmp_path: Path) -> None:
    first = make_core(tmp_path)
    first.add_request(Request("warm", list(PROMPT), SamplingParams(temperature=0, max_tokens=1)))
    while first.has_unfinished_requests():
        first.step()
    first.close()
    second = make_core(tmp_path)
    outs = prompt_logprobs(second)
    stats = second.make_stats().connector
    assert stats is not None and stats.hits == 0  # before the fix: 32 tokens from disk, their logprobs lost
    entries = outs[0].prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT) and entries[0] is None
    logits = tiny_loaded().model(mx.array(PROMPT)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = np.array(mx.take_along_axis(logprobs[:-1], mx.array(PROMPT[1:])[:, None], axis=-1)[:, 0])
    got = np.array([e.logprob if e is not None else np.nan for e in entries[1:]])
    np.testing.assert_allclose(got, want, atol=1e-3)
    second.close()
