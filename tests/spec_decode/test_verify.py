"""The verifier: every window position sampled as if its drafts were output, drafts kept while they agree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from metalserve.executor.sampler import Sampler
from metalserve.outputs import TokenLogprob
from metalserve.sampling_params import SamplingParams
from metalserve.spec_decode.verify import accept, verify_windows, window_rows


@dataclass
class State:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0))
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def test_accept_counts_the_agreeing_prefix() -> None:
    assert accept([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accept([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accept([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accept([], [3]) == 0


def test_window_rows_see_the_drafts_before_them_as_output() -> None:
    a, b = State([1, 2], [3]), State([8], [])
    rows = window_rows([a, b], [[4, 5], []])
    assert [r.output_token_ids for r in rows] == [[3], [3, 4], [3, 4, 5], []]
    assert [r.num_output_tokens for r in rows] == [1, 2, 3, 0]
    assert rows[3] is b and all(r.prompt_token_ids == [1, 2] for r in rows[:3])


@dataclass
class Recorded:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def test_windows_keep_accepted_drafts_plus_the_target_token_with_their_logprobs() -> None:
    targets = [4, 5, 9, 1, 7, 2, 6]  # request a: positions 0..3; b: its single row; c: positions 0..1

    def sample(logits: Any, rows: list[Any]) -> Recorded:
        assert len(rows) == 7
        return Recorded(targets, [TokenLogprob(t, -0.5) for t in targets])

    states = [State([1], []), State([2], []), State([3], [])]
    windows = verify_windows(sample, None, states, [[4, 5, 6], [], [3]])
    assert [w.token_ids for w in windows] == [[4, 5, 9], [7], [2]]
    assert [len(w.logprobs or []) for w in windows] == [3, 1, 1]


def test_a_frequency_penalty_sees_the_drafts_before_each_position() -> None:
    # Without the drafts as output, position 2 would pick token 3 again; the penalty on the draft 3
    # at position 1 makes the target pick 4 there, as non-speculative decoding would.
    logits = np.full((3, 8), -5.0, dtype=np.float32)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.5
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    state = State([1], [], params)
    windows = verify_windows(Sampler(), mx.array(logits), [state], [[3, 3]])
    assert windows[0].token_ids == [3, 4]
