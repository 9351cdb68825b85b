"""Finishing: EOS, stop ids, max_tokens, the context limit, min_tokens, aborts and outside stops."""

from __future__ import annotations

import pytest

from metalserve.outputs import TokenLogprob
from metalserve.request import RequestStatus
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import ModelRunnerOutput
from tests.scheduler.sched_helpers import make_request, make_scheduler, step


def run_tokens(tokens: list[int], **params: object) -> tuple[list[int], str | None, int | str | None]:
    """Feed `tokens` one per step to one request; return what it emitted and why it stopped."""
    s = make_scheduler(max_model_len=params.pop("max_model_len", 256))  # type: ignore[arg-type]
    s.add_request(make_request("r", params.pop("prompt", 5), **params))  # type: ignore[arg-type]
    emitted: list[int] = []
    feed = iter(tokens)
    while s.has_unfinished_requests():
        _, outputs = step(s, lambda _rid: next(feed))
        for o in outputs:
            emitted += o.new_token_ids
            if o.finished:
                assert not s.kv.groups[0].tables
                return emitted, o.finish_reason, o.stop_reason
    raise AssertionError("never finished")


def test_eos_stops_unless_ignored() -> None:
    assert run_tokens([5, 2, 9], max_tokens=10) == ([5, 2], "stop", None)
    assert run_tokens([5, 2, 9], max_tokens=3, ignore_eos=True) == ([5, 2, 9], "length", None)


def test_stop_token_id_sets_stop_reason() -> None:
    assert run_tokens([5, 42, 9], max_tokens=10, stop_token_ids=[42]) == ([5, 42], "stop", 42)


def test_max_tokens_and_context_limit() -> None:
    assert run_tokens([5, 6, 7, 8], max_tokens=3) == ([5, 6, 7], "length", None)
    # 5 prompt tokens, max_model_len 8: three outputs fill the context.
    assert run_tokens([5, 6, 7, 8], max_tokens=None, max_model_len=8) == ([5, 6, 7], "length", None)


def test_prompt_filling_the_context_yields_one_token() -> None:
    assert run_tokens([5, 6], max_tokens=None, max_model_len=5) == ([5], "length", None)


def test_min_tokens_defers_eos_and_stop_ids() -> None:
    # EOS (2) and the stop id (42) count only from the third output on.
    params: dict[str, object] = {"max_tokens": 10, "min_tokens": 3, "stop_token_ids": [42]}
    assert run_tokens([2, 42, 2, 9], **params) == ([2, 42, 2], "stop", None)
    assert run_tokens([2, 42, 5, 42], **params) == ([2, 42, 5, 42], "stop", 42)


def test_stop_wins_over_length_on_the_same_token() -> None:
    assert run_tokens([5, 2], max_tokens=2) == ([5, 2], "stop", None)


def test_several_tokens_in_one_step_are_cut_at_the_stop() -> None:
    s = make_scheduler()
    s.add_request(make_request("r", 5, max_tokens=10))
    out = s.schedule()
    lp = [TokenLogprob(t, -1.0) for t in (5, 2, 9)]
    outputs = s.update_from_output(out, ModelRunnerOutput({"r": [5, 2, 9]}, {"r": lp}))
    assert outputs[0].new_token_ids == [5, 2]
    assert outputs[0].new_logprobs == lp[:2]
    assert outputs[0].finish_reason == "stop"


def test_abort_frees_at_next_step_and_reports() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 20, max_tokens=10))
    s.add_request(make_request("w", 5, max_tokens=10))
    s.schedule()  # no update yet: abort arrives between steps
    s.abort_requests(["a", "unknown"])
    assert s.requests["a"].status is RequestStatus.RUNNING  # nothing happens mid-step
    out = s.schedule()
    assert out.finished_req_ids == {"a"}
    assert "a" not in out.num_scheduled_tokens
    assert s.kv.get_block_ids("a") == ([],)
    outputs = s.update_from_output(out, ModelRunnerOutput({}))
    assert [(o.request_id, o.finish_reason, o.num_prompt_tokens) for o in outputs] == [("a", "abort", 20)]


def test_abort_of_waiting_request() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 5, max_tokens=10))
    s.add_request(make_request("b", 5, max_tokens=10))
    step(s)
    s.abort_requests(["b"])
    out, outputs = step(s)
    assert out.finished_req_ids == {"b"}
    assert ("b", "abort") in [(o.request_id, o.finish_reason) for o in outputs]
    assert len(s.waiting) == 0
    assert len(s.requests) == 1


def test_abort_output_keeps_engine_busy_until_delivered() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=10))
    s.abort_requests(["a"])
    out = s.schedule()
    assert out.is_empty
    assert not s.requests
    assert s.has_unfinished_requests()
    assert [o.finish_reason for o in s.update_from_output(out, ModelRunnerOutput({}))] == ["abort"]
    assert not s.has_unfinished_requests()


def test_finish_from_outside_frees_without_output() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=10))
    step(s)
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    out, outputs = step(s)
    assert out.finished_req_ids == {"a"}
    assert outputs == []
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_requests(["x"], RequestStatus.RUNNING)


def test_cached_tokens_reported_and_runner_misuse_caught() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 20, max_tokens=1))
    step(s)
    step(s)
    s.add_request(make_request("b", 20, max_tokens=1))
    _, outputs = step(s)
    assert [(o.request_id, o.num_cached_tokens) for o in outputs] == [("b", 16)]
    s.add_request(make_request("c", 100, max_tokens=1))
    out = s.schedule()  # budget 64: c is still prefilling
    with pytest.raises(ValueError, match="before its prompt was fully computed"):
        s.update_from_output(out, ModelRunnerOutput({"c": [1]}))


def test_one_stop_rule_for_the_scheduler_and_the_sampler() -> None:
    """`SamplingParams.stop_ids` is the set both the scheduler's stop hint and the min_tokens mask use."""
    eos = frozenset({2, 7})
    assert SamplingParams(stop_token_ids=[42, 2]).stop_ids(eos) == {2, 7, 42}
    assert SamplingParams(stop_token_ids=[42], ignore_eos=True).stop_ids(eos) == {42}
    assert SamplingParams(ignore_eos=True).eos_stop_ids(eos) == frozenset()
    # A stop id that is also EOS ends the request as EOS (no stop_reason), unless EOS is ignored.
    assert run_tokens([5, 2], max_tokens=10, stop_token_ids=[2]) == ([5, 2], "stop", None)
    assert run_tokens([5, 2], max_tokens=10, stop_token_ids=[2], ignore_eos=True) == ([5, 2], "stop", 2)
