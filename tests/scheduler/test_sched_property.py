"""Random add / schedule / sample / abort / finish sequences against the scheduler and KV manager.

After every step: every block is exactly free or referenced, reference counts equal holders, only
cached blocks are shared, the budget and max_num_seqs hold, the runner's view of block tables (built
from the diffs alone) matches the manager's. At the end: no request is lost and all blocks are free.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from metalserve.config import EngineConfig
from metalserve.kvcache.block_pool import NULL_BLOCK_ID
from metalserve.request import Request, RequestStatus
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from metalserve.scheduler.scheduler import Scheduler

BS = 8
MAX_MODEL_LEN = 48
EOS = 2
BASES = [list(range(100, 100 + MAX_MODEL_LEN)), list(range(300, 300 + MAX_MODEL_LEN))]

configs = st.fixed_dictionaries(
    {
        "block_size": st.just(BS),
        "max_num_seqs": st.integers(1, 6),
        "max_num_batched_tokens": st.integers(4, 64),
        "long_prefill_token_threshold": st.sampled_from([0, 5, 16]),
        "enable_prefix_caching": st.sampled_from([True, True, False]),
        "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    }
)
add_op = st.tuples(
    st.just("add"),
    st.integers(1, MAX_MODEL_LEN),  # prompt length
    st.sampled_from([0, 0, 1, 2]),  # a shared base prompt (2: random tokens)
    st.sampled_from([None, None, None, "t1", "t2"]),  # cache salt
    st.integers(1, 24),  # max_tokens
    st.integers(0, 3),  # priority
)
ops = st.lists(
    st.one_of(
        add_op,
        add_op,
        st.tuples(st.just("step"), st.integers(0, 2**16)),
        st.tuples(st.just("step"), st.integers(0, 2**16)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    min_size=8,
    max_size=60,
)


@dataclass
class Done:
    """Requests reported finished in an output (each once) and released to the runner."""

    reported: dict[str, str | None] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)


class FakeRunner:
    """Keeps block tables from the diffs alone, as the real runner's persistent batch does, and a
    fake KV pool holding the token id written at each slot, to check reads of prefix-cache hits."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.slots: dict[tuple[int, int], int] = {}

    def forward(self, s: Scheduler, out: SchedulerOutput) -> None:
        """Every token already computed must be in the pool; then write this step's tokens."""
        for rid in out.num_scheduled_tokens:
            table, done = self.tables[rid], self.computed[rid] - out.num_scheduled_tokens[rid]
            tokens = s.requests[rid].token_ids_between(0, done)
            assert [self.slots.get((table[p // BS], p % BS)) for p in range(done)] == tokens, rid
        for rid, n in out.num_scheduled_tokens.items():
            table, start = self.tables[rid], self.computed[rid] - n
            for p, tok in enumerate(s.requests[rid].token_ids_between(start, start + n), start):
                self.slots[(table[p // BS], p % BS)] = tok

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
            self.computed.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.request_id not in self.tables
            self.tables[new.request_id] = list(new.block_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            assert self.computed[cached.request_id] == cached.num_computed_tokens
            self.tables[cached.request_id] += cached.new_block_ids
        for rid, n in out.num_scheduled_tokens.items():
            self.computed[rid] += n
            assert len(self.tables[rid]) * BS >= self.computed[rid]


def check_blocks(s: Scheduler) -> None:
    pool = s.kv.pool
    free_ids = pool.free_queue.block_ids()
    holders = Counter(b.block_id for blocks in s.kv.req_to_blocks.values() for b in blocks)
    assert NULL_BLOCK_ID not in holders and NULL_BLOCK_ID not in free_ids
    not_grown = pool.num_blocks - pool.num_allocated_blocks
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks - not_grown
    assert set(free_ids).isdisjoint(holders)
    assert set(free_ids) | set(holders) == set(range(1, pool.num_allocated_blocks))
    assert pool._num_free_cached == sum(pool.blocks[i].block_hash is not None for i in free_ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        if block.ref_cnt > 1:
            assert block.block_hash is not None and pool.cached[block.block_hash] is block
    for rid, blocks in s.kv.req_to_blocks.items():
        assert len({b.block_id for b in blocks}) == len(blocks), rid
    for h, block in pool.cached.items():
        assert block.block_hash == h


def check_requests(s: Scheduler, cfg: EngineConfig) -> None:
    running = {r.request_id for r in s.running}
    waiting = {r.request_id for r in s.waiting}
    assert running.isdisjoint(waiting)
    assert running | waiting == set(s.requests)
    assert len(s.running) <= cfg.max_num_seqs
    for r in s.running:
        assert r.status is RequestStatus.RUNNING
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.request_id not in s.kv.req_to_blocks and r.num_computed_tokens == 0


def check_output(s: Scheduler, cfg: EngineConfig, out: SchedulerOutput, runner: FakeRunner) -> None:
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
    assert all(n >= 1 for n in out.num_scheduled_tokens.values())
    assert out.num_kv_blocks == s.kv.pool.num_allocated_blocks
    runner.apply(out)
    runner.forward(s, out)
    assert all(b < out.num_kv_blocks for table in runner.tables.values() for b in table)
    for rid in out.num_scheduled_tokens:
        assert runner.tables[rid] == s.kv.get_block_ids(rid)
        assert runner.computed[rid] == s.requests[rid].num_computed_tokens <= MAX_MODEL_LEN


def do_step(s: Scheduler, cfg: EngineConfig, runner: FakeRunner, rng: random.Random, done: Done) -> None:
    """One schedule + sample + update, checking everything after each half."""
    out = s.schedule()
    check_output(s, cfg, out, runner)
    check_blocks(s)
    assert not out.finished_req_ids & done.released
    done.released |= out.finished_req_ids
    sampled = {
        rid: [EOS if rng.random() < 0.1 else rng.randrange(3, 50)]
        for rid in out.num_scheduled_tokens
        if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens
    }
    for o in s.update_from_output(out, ModelRunnerOutput(sampled)):
        if o.finished:
            assert o.request_id not in done.reported
            done.reported[o.request_id] = o.finish_reason
    check_blocks(s)
    check_requests(s, cfg)


def make_request(i: int, op: tuple[Any, ...], rng: random.Random) -> Request:
    _, length, base, salt, max_tokens, priority = op
    prompt = BASES[base][:length] if base < 2 else [rng.randrange(3, 50) for _ in range(length)]
    params = SamplingParams(max_tokens=max_tokens)
    return Request(f"r{i}", prompt, params, frozenset({EOS}), float(i), priority, salt)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg_kwargs=configs, extra_blocks=st.integers(0, 4), initial=st.none() | st.integers(2, 8), ops=ops)
def test_random_sequences_keep_invariants(
    cfg_kwargs: dict[str, Any], extra_blocks: int, initial: int | None, ops: list[tuple[Any, ...]]
) -> None:
    """With `initial`, the pool starts that small and grows while the sequence runs."""
    cfg = EngineConfig(**cfg_kwargs)
    s = Scheduler(cfg, MAX_MODEL_LEN // BS + 1 + extra_blocks, MAX_MODEL_LEN, initial_blocks=initial)
    runner, rng, done = FakeRunner(), random.Random(0), Done()
    added: list[str] = []
    aborted: set[str] = set()
    for op in ops:
        if op[0] == "add":
            s.add_request(make_request(len(added), op, rng))
            added.append(f"r{len(added)}")
        elif op[0] == "step":
            rng.seed(op[1])
            do_step(s, cfg, runner, rng, done)
        elif added:
            rid = added[op[1] % len(added)]
            if op[0] == "abort":
                if rid in s.requests:
                    aborted.add(rid)
                s.abort_requests([rid])
            else:
                s.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        do_step(s, cfg, runner, rng, done)
    assert not s.has_unfinished_requests()
    # None lost: each was reported finished, or (finished from outside) released to the runner.
    assert set(done.reported) | done.released == set(added)
    assert {rid for rid, why in done.reported.items() if why == "abort"} <= aborted
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks
    assert s.kv.req_to_blocks == {}
    event(f"preempted: {s.num_preemptions > 0}")
    event(f"prefix hits: {s.kv.prefix_cache_hits > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"pool grew: {initial is not None and s.kv.pool.num_allocated_blocks > initial}")
