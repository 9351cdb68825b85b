"""Rank 0's batch queue (two steps in flight) over a fake runner: the same tokens as one step at a time,
no request in two steps at once unless it is a prompt's earlier chunk, and both slots really used."""

from __future__ import annotations

from dataclasses import dataclass, field

from metalserve.config import EngineConfig
from metalserve.distributed.core import PipelineEngineCore
from metalserve.engine.core import EngineCore
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from metalserve.scheduler.scheduler import Scheduler


@dataclass
class FakeFlight:
    so: SchedulerOutput
    sampling: list[tuple[str, list[int]]]
    step_id: int


@dataclass
class FakeRunner:
    """Its 'model': the next token is a hash of every token so far; it checks what the pipe holds."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    in_flight: dict[int, set[str]] = field(default_factory=dict)
    sampling_in_flight: set[str] = field(default_factory=set)
    most_in_flight: int = 0
    steps: int = 0

    def submit(self, so: SchedulerOutput) -> FakeFlight | None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.request_id] = list(new.token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            self.computed[cached.request_id] = cached.num_computed_tokens
        if so.total_num_scheduled_tokens == 0:
            return None
        sampling = []
        for rid, n in so.num_scheduled_tokens.items():
            assert rid not in self.sampling_in_flight, f"{rid} scheduled while its token is in the pipe"
            if self.computed[rid] + n == len(self.tokens[rid]):
                sampling.append((rid, self.tokens[rid]))
                self.sampling_in_flight.add(rid)
        self.in_flight[self.steps] = set(so.num_scheduled_tokens)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        self.steps += 1
        return FakeFlight(so, sampling, self.steps - 1)

    def complete(self, flight: FakeFlight) -> ModelRunnerOutput:
        del self.in_flight[flight.step_id]
        sampled: dict[str, list[int]] = {rid: [] for rid in flight.so.num_scheduled_tokens}
        for rid, toks in flight.sampling:
            self.sampling_in_flight.discard(rid)
            if self.tokens.get(rid) is toks:
                token = (sum(toks) * 31 + len(toks)) % 97
                toks.append(token)
                sampled[rid] = [token]
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        flight = self.submit(so)
        return ModelRunnerOutput(sampled_token_ids={}) if flight is None else self.complete(flight)


def _run(core: EngineCore, stagger: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    prompts = [[(5 * j + i) % 90 + 1 for i in range(6 + 7 * j)] for j in range(6)]
    got: dict[str, list[int]] = {}
    steps = 0
    while prompts or core.has_unfinished_requests():
        if prompts and steps % stagger == 0:
            rid = f"r{len(got)}"
            core.add_request(Request(rid, prompts.pop(0), params))
            got[rid] = []
        for out in core.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
    return got


def test_two_in_flight_gives_the_same_tokens_and_uses_both_slots() -> None:
    config = EngineConfig(block_size=8, max_num_batched_tokens=16, max_num_seqs=8)
    one = EngineCore(Scheduler(config, 64, 128), FakeRunner(), 128)  # type: ignore[arg-type]
    runner = FakeRunner()
    two = PipelineEngineCore(Scheduler(config, 64, 128), runner, 128, depth=2)  # type: ignore[arg-type]
    expected = _run(one, stagger=3)
    assert _run(two, stagger=3) == expected
    assert all(len(t) == 9 for t in expected.values())
    assert runner.most_in_flight == 2


def test_preemption_under_a_tight_pool_keeps_tokens_right() -> None:
    config = EngineConfig(block_size=8, max_num_batched_tokens=16, max_num_seqs=8)
    expected = _run(EngineCore(Scheduler(config, 64, 128), FakeRunner(), 128), stagger=1)  # type: ignore[arg-type]
    scheduler = Scheduler(config, 12, 64)  # 11 usable blocks for six requests of up to 7: preemptions
    two = PipelineEngineCore(scheduler, FakeRunner(), 64, depth=2)  # type: ignore[arg-type]
    assert _run(two, stagger=1) == expected
    assert scheduler.num_preemptions > 0
