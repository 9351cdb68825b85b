"""`prompt_logprobs` (vLLM's field) and `echo` with `logprobs` (OpenAI's legacy form) on /v1/completions,
through the real threaded server over a real engine (a tiny llama, int8 KV pages) and the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import openai
import pytest

from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.engine_thread import EngineThread
from metalserve.serving.build import build_engine_core
from tests.api.conftest import Served, app_of_engine, live
from tests.api.fakes import tiny_tokenizer
from tests.models import golden
from tests.models.archs import build

VOCAB = 512  # covers the tiny tokenizer's ids
PROMPT = [17, 250, 3, 96, 311, 45, 45, 120, 7, 260, 33, 18]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    config = EngineConfig(
        kv_cache_memory=1 << 22, block_size=16, max_num_seqs=4, max_model_len=256, kv_cache_dtype="int8"
    )
    thread = EngineThread()  # as the server does: the core is built on the thread that steps it
    loaded = golden.loaded_of(build("llama", vocab_size=VOCAB), "llama", 256)
    core = thread.call(build_engine_core, config, loaded)
    engine = AsyncEngine(core, tiny_tokenizer(), model_name="tiny", max_model_len=256, eos_token_ids={2}, thread=thread)
    served = Served(app_of_engine(engine, ServerSettings(log_stats_interval=0)), None, engine)  # type: ignore[arg-type]
    with live(served) as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", timeout=60)


def _reference() -> np.ndarray:
    """mlx-lm's own forward of the same tiny model over the prompt."""
    logits = build("llama", vocab_size=VOCAB)(mx.array(PROMPT)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(mx.take_along_axis(logprobs[:-1], mx.array(PROMPT[1:])[:, None], axis=-1)[:, 0])


def test_prompt_logprobs_in_vllm_s_format(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    items = r.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(items) == len(PROMPT) and items[0] is None
    got = []
    for item, token in zip(items[1:], PROMPT[1:], strict=True):
        own = item[str(token)]
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        assert 2 <= len(item) <= 3  # the token itself and the two best (it may be one of them)
        got.append(own["logprob"])
    np.testing.assert_allclose(got, _reference(), atol=0.5)  # int8 pages: within their rounding
    assert r.choices[0].logprobs is None  # not asked for


def test_echo_with_logprobs_puts_the_prompt_first(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(PROMPT) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1 : len(PROMPT)], _reference(), atol=0.5)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset is not None and lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.choices[0].text.startswith(tiny_tokenizer().decode(PROMPT, skip_special_tokens=True))
    assert "prompt_logprobs" not in (r.choices[0].model_extra or {})  # only when asked for by name


def test_streamed_prompt_logprobs_come_with_the_first_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, stream=True, extra_body={"prompt_logprobs": 0}
        )
    )
    firsts = [c for c in chunks if c.choices and (c.choices[0].model_extra or {}).get("prompt_logprobs")]
    assert len(firsts) == 1 and firsts[0] is chunks[0]
    items = firsts[0].choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert items[0] is None and all(str(t) in i for i, t in zip(items[1:], PROMPT[1:], strict=True))


def test_a_bad_prompt_logprobs_is_a_400_in_openai_s_format(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": -1})
    assert "prompt_logprobs" in str(err.value)
