"""`metalserve generate` runs through the engine core, so it stops where the server does."""

from __future__ import annotations

from dataclasses import replace

from metalserve.config import EngineConfig
from metalserve.generate import Generation, generate
from metalserve.sampling_params import SamplingParams
from tests.engine.test_core import tiny_loaded

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]


class Words:
    """A tokenizer stand-in: token ids as words."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def run(max_model_len: int | None = None, **params: object) -> Generation:
    loaded = replace(tiny_loaded(), tokenizer=Words())
    config = EngineConfig(block_size=8, max_model_len=max_model_len)
    (out,) = generate(loaded, [PROMPT], SamplingParams(temperature=0, **params), config)  # type: ignore[arg-type]
    return out


def test_generate_honours_stop_ids_min_tokens_and_the_context_limit() -> None:
    free = run(max_tokens=12, ignore_eos=True)
    seq = free.token_ids
    assert len(seq) == 12 and free.finish_reason == "length"
    assert free.text == " ".join(map(str, seq))
    # A stop id ends the request at its first occurrence...
    stop = seq[3]
    first = seq.index(stop)
    stopped = run(max_tokens=12, stop_token_ids=[stop])
    assert (stopped.token_ids, stopped.finish_reason) == (seq[: first + 1], "stop")
    # ... but not before min_tokens outputs exist (the sampler masks it until then, as vLLM does).
    held = run(max_tokens=12, stop_token_ids=[stop], min_tokens=first + 2)
    assert held.token_ids[:first] == seq[:first]
    assert stop not in held.token_ids[: first + 2] and len(held.token_ids) >= first + 2
    assert held.finish_reason == ("stop" if held.token_ids[-1] == stop else "length")
    # The context limit stops a request without max_tokens, as the server's scheduler does.
    ctx = run(max_model_len=len(PROMPT) + 5, ignore_eos=True)
    assert (ctx.token_ids, ctx.finish_reason) == (seq[:5], "length")


def test_generate_rejects_a_prompt_longer_than_the_context() -> None:
    try:
        run(max_model_len=len(PROMPT) - 1, max_tokens=2)
    except ValueError as e:
        assert "context" in str(e)
    else:
        raise AssertionError("a prompt longer than the context was accepted")
