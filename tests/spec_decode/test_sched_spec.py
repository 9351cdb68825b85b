"""Scheduler side of speculation: drafts are lookahead inside the budget, rejected positions roll back,
and only accepted tokens ever reach the prefix cache."""

from __future__ import annotations

from metalserve.scheduler.output import ModelRunnerOutput
from metalserve.scheduler.scheduler import Scheduler
from tests.scheduler.sched_helpers import make_request, make_scheduler, step


def decoding(sched: Scheduler, prompt: int = 14, **params: object) -> str:
    """Add a request and run its prefill; it is then one sampled token ahead of its KV."""
    sched.add_request(make_request("a", prompt, max_tokens=params.pop("max_tokens", 32), **params))
    step(sched)
    return "a"


def cached_blocks(sched: Scheduler) -> int:
    return sum(b.block_hash is not None for b in sched.kv.pool.blocks)


def test_drafts_are_scheduled_after_the_last_token_with_slots_for_all_of_them() -> None:
    sched = make_scheduler()
    rid = decoding(sched)
    req = sched.requests[rid]
    req.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {rid: 5}
    assert out.scheduled_spec_decode_tokens == {rid: [5, 6, 7, 8]}
    assert req.num_computed_tokens == 15 + 4
    assert len(sched.kv.get_block_ids(rid)[0]) == 3  # 19 positions in blocks of 8


def test_rejected_drafts_roll_back_and_the_accepted_ones_are_output() -> None:
    sched = make_scheduler()
    rid = decoding(sched)
    req = sched.requests[rid]
    req.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    # Drafts 5 and 6 accepted, then the target said 9: three new tokens; the runner proposes [1, 2].
    outputs = sched.update_from_output(out, ModelRunnerOutput({rid: [5, 6, 9]}, spec_token_ids={rid: [1, 2]}))
    assert outputs[0].new_token_ids == [5, 6, 9]
    assert req.output_token_ids == [7, 5, 6, 9]
    assert req.num_computed_tokens == req.num_tokens - 1 == 17
    assert req.spec_token_ids == [1, 2]
    c = sched.spec_counter
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (1, 4, 2, [1, 1, 0, 0])
    stats = sched.make_stats()
    got = (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos)
    assert got == (4, 2, (1, 1, 0, 0))


def test_only_accepted_tokens_are_hashed_into_the_prefix_cache() -> None:
    sched = make_scheduler()
    rid = decoding(sched)  # 14 prompt tokens + 1 sampled: 15 tokens, 14 computed
    sched.requests[rid].spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()  # positions 14..18: block 1 (8..15) fills up with draft positions
    sched.update_from_output(out, ModelRunnerOutput({rid: [9]}))  # every draft rejected
    assert sched.requests[rid].num_computed_tokens == 15
    sched.abort_requests([rid])
    sched.update_from_output(sched.schedule(), ModelRunnerOutput({}))
    # Position 15 holds the KV of draft 5, not of the real token 9: block 1 must not be published.
    assert cached_blocks(sched) == 1


def test_drafts_are_cut_to_the_budget_max_tokens_and_context() -> None:
    sched = make_scheduler(max_num_batched_tokens=3)
    rid = decoding(sched, prompt=2)
    sched.requests[rid].spec_token_ids = [5, 6, 7, 8]
    assert sched.schedule().scheduled_spec_decode_tokens == {rid: [5, 6]}  # budget 3: the token + 2

    sched = make_scheduler()
    rid = decoding(sched, max_tokens=3)  # 1 output so far: 2 more, the window's last token is one
    sched.requests[rid].spec_token_ids = [5, 6, 7, 8]
    assert sched.schedule().scheduled_spec_decode_tokens == {rid: [5]}

    sched = make_scheduler(max_model_len=17)
    rid = decoding(sched, max_tokens=None)  # 15 tokens: 2 more fit, the window's last token is one
    sched.requests[rid].spec_token_ids = [5, 6, 7, 8]
    assert sched.schedule().scheduled_spec_decode_tokens == {rid: [5]}


def test_no_room_for_the_drafts_decodes_without_them_instead_of_preempting() -> None:
    sched = make_scheduler(num_blocks=4, max_model_len=24)  # 3 usable blocks of 8
    sched.add_request(make_request("a", 14, max_tokens=8))
    sched.add_request(make_request("b", 4, max_tokens=8))
    step(sched)  # a holds 2 blocks, b the third
    sched.requests["a"].spec_token_ids = [5, 6]  # positions 15..16 would need a fourth block
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and not out.scheduled_spec_decode_tokens
    assert not out.preempted_req_ids


def test_eos_inside_a_window_ends_the_request_there() -> None:
    sched = make_scheduler()
    rid = decoding(sched)
    sched.requests[rid].spec_token_ids = [5, 2, 6]  # 2 is EOS
    out = sched.schedule()
    (output,) = sched.update_from_output(out, ModelRunnerOutput({rid: [5, 2, 6, 8]}))
    assert output.new_token_ids == [5, 2] and output.finish_reason == "stop"
    assert rid not in sched.requests
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_a_preempted_request_drops_its_drafts() -> None:
    sched = make_scheduler()
    rid = decoding(sched)
    req = sched.requests[rid]
    req.spec_token_ids = [5, 6]
    sched._preempt(req, __import__("metalserve.scheduler.step", fromlist=["StepBuilder"]).StepBuilder(64))
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0
