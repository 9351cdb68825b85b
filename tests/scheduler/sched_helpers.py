"""A fake runner and builders for the scheduler tests."""

from __future__ import annotations

from collections.abc import Callable

from metalserve.config import EngineConfig
from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from metalserve.scheduler.scheduler import Scheduler


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256, **config: object) -> Scheduler:
    defaults: dict[str, object] = {"block_size": 8, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    defaults.update(config)
    return Scheduler(EngineConfig(**defaults), num_blocks, max_model_len)  # type: ignore[arg-type]


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int | None = 4,
    arrival: float = 0.0,
    priority: int = 0,
    **params: object,
) -> Request:
    tokens = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else list(prompt)
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    eos = frozenset({2})
    return Request(request_id, tokens, sp, eos_token_ids=eos, arrival_time=arrival, priority=priority)


def sample_for(sched: Scheduler, out: SchedulerOutput, token: Callable[[str], int] | int = 7) -> ModelRunnerOutput:
    """What a runner samples: one token for each request whose whole sequence is now computed."""
    sampled: dict[str, list[int]] = {}
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_computed_tokens >= req.num_tokens:
            sampled[rid] = [token(rid) if callable(token) else token]
    return ModelRunnerOutput(sampled)


def step(sched: Scheduler, token: Callable[[str], int] | int = 7) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    return out, sched.update_from_output(out, sample_for(sched, out, token))
