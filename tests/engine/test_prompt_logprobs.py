"""sampling_params.prompt_logprobs: every prompt token's logprob, computed whole (chunked, never from the
prefix cache), equal to the model's own full forward; on quantized pages too."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.models import golden
from tests.models.archs import VOCAB, build


def reference_prompt_logprobs(arch: str, prompt: list[int]) -> np.ndarray:
    """mlx-lm's own forward over the whole prompt: log p(token i | tokens before it), i >= 1."""
    logits = build(arch)(mx.array(prompt)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(mx.take_along_axis(logprobs[:-1], mx.array(prompt[1:])[:, None], axis=-1)[:, 0])


def run(core: EngineCore, rid: str, prompt: list[int], top: int = 3) -> list[EngineCoreOutput]:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=top)
    core.add_request(Request(rid, list(prompt), params))
    outs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outs += [o for o in core.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize(("arch", "storage"), [("llama", "auto"), ("gemma3_text", "auto"), ("llama", "int8")])
def test_prompt_logprobs_match_the_full_forward_over_chunks_and_a_warm_prefix_cache(arch: str, storage: str) -> None:
    (prompt,) = golden.prompts([70], VOCAB, seed=2)
    config = EngineConfig(
        kv_cache_memory=1 << 24, block_size=16, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_dtype=storage
    )  # type: ignore[arg-type]
    core = build_engine_core(config, golden.loaded_of(build(arch), arch))
    plain = Request("warm", list(prompt), SamplingParams(temperature=0, max_tokens=1))
    core.add_request(plain)  # publishes the prompt's blocks: the next request must not take them
    while core.has_unfinished_requests():
        core.step()
    outs = run(core, "p", prompt)
    firsts = [o for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0] is outs[0] and outs[0].num_cached_tokens == 0
    entries = firsts[0].prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(prompt)
    got = np.array([e.logprob for e in entries[1:] if e is not None])
    want = reference_prompt_logprobs(arch, prompt)
    if storage == "auto":
        np.testing.assert_allclose(got, want, atol=1e-3)
    else:  # int8's rounding, largest on unlikely tokens (logprobs near -15)
        assert np.abs(got - want).mean() < 0.1 and np.abs(got - want).max() < 0.5
    for e, token in zip(entries[1:], prompt[1:], strict=True):
        assert e is not None and e.token_id == token and len(e.top) == 3 and e.rank is not None and e.rank >= 1
        assert (e.rank == 1) == (e.top[0][0] == token) and e.top[0][1] >= e.logprob - 1e-6
    mx.clear_cache()


def test_prompt_logprobs_are_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be between 0 and"):
        SamplingParams(prompt_logprobs=-1)
