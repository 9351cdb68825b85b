"""A minimal stand-in for the scheduler: sequential block allocation, prompts in chunks, then decode.

It exists to exercise the runner in tests without the real scheduler and KV manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metalserve.executor.runner import ModelRunner
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: bool = False

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


def _blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def run_to_completion(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    chunk_size: int = 1 << 30,
    eos_token_ids: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """Run every prompt together until each has max_tokens outputs or hits EOS; return the outputs."""
    bs = runner.spec.block_size
    seqs = [_Seq(f"req-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    next_block, done = 0, set[str]()
    while len(done) < len(seqs):
        new, cached, scheduled = [], [], {}
        for s in seqs:
            if s.request_id in done:
                continue
            n = min(chunk_size, s.tokens - s.computed)
            need = _blocks_needed(s.computed + n, bs) - len(s.blocks)
            fresh = list(range(next_block, next_block + need))
            if next_block + need > runner.spec.num_blocks:
                raise RuntimeError("the KV pool is too small for these prompts")
            next_block += need
            s.blocks += fresh
            scheduled[s.request_id] = n
            if not s.sent:
                new.append(NewRequestData(s.request_id, list(s.prompt), len(s.prompt), s.params, (list(s.blocks),), 0))
                s.sent = True
            else:
                cached.append(CachedRequestData(s.request_id, (fresh,), s.computed))
        finished = set()
        so = SchedulerOutput(new, cached, scheduled, sum(scheduled.values()))
        out = runner.execute_model(so)
        for s in seqs:
            if s.request_id not in scheduled:
                continue
            s.computed += scheduled[s.request_id]
            for tok in out.sampled_token_ids.get(s.request_id, []):
                s.outputs.append(tok)
                stop = tok in eos_token_ids and not s.params.ignore_eos
                if stop or len(s.outputs) >= (s.params.max_tokens or 1 << 30):
                    finished.add(s.request_id)
        done |= finished
        if finished:
            runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids=finished))
    return [s.outputs for s in seqs]
