"""A stop string completed inside a verified window: text, token ids, logprobs and usage end there."""

from __future__ import annotations

import asyncio

from metalserve.engine.detokenizer import IncrementalDetokenizer
from metalserve.engine.request_output import IterationStats
from metalserve.engine.request_state import RequestState, make_output
from metalserve.outputs import EngineCoreOutput, TokenLogprob
from metalserve.sampling_params import SamplingParams
from tests.api.fakes import tiny_tokenizer

TOK = tiny_tokenizer()


def test_tokens_after_the_stop_string_are_dropped() -> None:
    words = [TOK.encode(w, add_special_tokens=False) for w in ("Hello", " world", " STOP", " more", " words")]
    ids = [t for w in words for t in w]
    stop_end = sum(len(w) for w in words[:3])  # the token that completes " STOP"
    params = SamplingParams(stop=[" STOP"])
    prompt = TOK.encode("Say", add_special_tokens=False)
    loop = asyncio.new_event_loop()
    state = RequestState(loop, asyncio.Queue(), IncrementalDetokenizer(TOK, prompt, params), len(prompt), lambda: None)
    lps = [TokenLogprob(t, -1.0) for t in ids]
    out = make_output(
        EngineCoreOutput(request_id="r", new_token_ids=ids, new_logprobs=lps), state, 0.0, IterationStats()
    )
    loop.close()
    assert out.text == "Hello world" and out.finish_reason == "stop" and out.stop_reason == " STOP"
    assert out.token_ids == ids[:stop_end] and out.logprobs == lps[:stop_end]
    assert out.num_output_tokens == stop_end
