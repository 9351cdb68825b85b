"""Incremental detokenization: multi-byte characters, stop strings that span tokens, hold-back."""

from __future__ import annotations

import pytest

from metalserve.engine.detokenizer import IncrementalDetokenizer
from metalserve.sampling_params import SamplingParams
from tests.api.fakes import tiny_tokenizer

TEXT = "Hello world! caf\u00e9 \U0001f600 \u65e5\u672c\u8a9e STOP now. The end."


def _stream(text: str, params: SamplingParams, per_step: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("The capital", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    for start in range(0, len(ids), per_step):
        chunk = ids[start : start + per_step]
        deltas.append(detok.update(chunk, finished=start + per_step >= len(ids)))
        if detok.stop_reason is not None:
            break
    return deltas, detok


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_streamed_text_equals_full_decode(per_step: int) -> None:
    deltas, detok = _stream(TEXT, SamplingParams(), per_step)
    assert "".join(deltas) == TEXT
    assert detok.output_text == TEXT
    # No delta ever carries half a character.
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_split_over_tokens_arrives_whole() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("\U0001f600", add_special_tokens=False)
    assert len(ids) > 1  # the premise: one character, several tokens
    deltas, _ = _stream("\U0001f600", SamplingParams())
    assert [d for d in deltas if d] == ["\U0001f600"]


def test_stop_string_spanning_tokens_truncates() -> None:
    deltas, detok = _stream(TEXT, SamplingParams(stop=["STOP now"]))
    assert detok.stop_reason == "STOP now"
    assert "".join(deltas) == "Hello world! caf\u00e9 \U0001f600 \u65e5\u672c\u8a9e "
    assert not any("S" in d for d in deltas)  # not even the start of the stop string leaks


def test_stop_string_included_when_asked() -> None:
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    deltas, detok = _stream(TEXT, params)
    assert "".join(deltas).endswith("STOP")
    assert detok.stop_reason == "STOP"


def test_earliest_stop_wins_and_partial_stop_is_held_back() -> None:
    tok = tiny_tokenizer()
    params = SamplingParams(stop=["world", "Hello w"])
    detok = IncrementalDetokenizer(tok, [], params)
    out = "".join(detok.update([i], False) for i in tok.encode("Hello world", add_special_tokens=False))
    assert detok.stop_reason == "Hello w"
    assert out == ""


def test_held_back_text_is_released_at_finish() -> None:
    deltas, detok = _stream("The end.", SamplingParams(stop=["never appears here"]))
    assert detok.stop_reason is None
    assert deltas[-1] != ""  # the held-back tail arrives with the last token
    assert "".join(deltas) == "The end."


def test_special_tokens_skipped_or_kept() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("Hello", add_special_tokens=False) + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [], SamplingParams())
    assert skip.update(ids, finished=True) == "Hello"
    keep = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False))
    assert keep.update(ids, finished=True) == "Hello<|im_end|>"


def test_incomplete_character_flushed_at_finish() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("\U0001f600", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert detok.update(ids[:1], finished=False) == ""
    assert detok.update([], finished=True) == "\ufffd"
