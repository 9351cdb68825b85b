"""The random sequences of test_sched_property.py in the order async scheduling runs them (engine/core.py
`_step_ahead`): step k+1 is scheduled before step k's tokens are known (placeholders), then step k
finishes (the connector's saves of step k are read out of the pool, its finished loads reported), then
step k+1's forward runs, then step k's outputs are made. Every read must still find what was written,
and with the disk connector every saved block must hold the tokens its key stands for (a later load
writes them back and the reads check them), so a save read out before its forward, or a load reported
before its blocks are in, fails here. No MLX.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from metalserve.config import EngineConfig
from metalserve.kvcache.connector.base import ConnectorOutput
from metalserve.kvcache.connector.disk_keys import StoreNamespace
from metalserve.kvcache.connector.disk_scheduler import DiskConnectorScheduler, group_needs
from metalserve.kvcache.specs import FullAttention
from metalserve.request import Request, RequestStatus
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from metalserve.scheduler.scheduler import Scheduler
from tests.kvcache.connector_helpers import MemoryIndex
from tests.scheduler.test_sched_property import (
    BS,
    DISK_MODES,
    EOS,
    GROUPS,
    MAX_MODEL_LEN,
    Done,
    FakeDiskWorker,
    FakeRunner,
    check_blocks,
    check_requests,
    check_tables_match,
    configs,
    disk_ops,
    evict_free_cached,
    group_tables,
    make_request,
    ops,
)


@dataclass
class Flight:
    """A launched step: what was scheduled, who samples a token in it, and its requests (one may finish
    on the token of the step before, after this step was launched)."""

    out: SchedulerOutput
    samples: list[str]
    requests: dict[str, Request]


class PipelinedEngine:
    """The fakes driven in `_step_ahead`'s order, checking the same invariants as the in-order run."""

    def __init__(self, s: Scheduler, cfg: EngineConfig, runner: FakeRunner, disk: FakeDiskWorker | None) -> None:
        self.s, self.cfg, self.runner, self.disk = s, cfg, runner, disk
        self.done = Done()
        self.in_flight: Flight | None = None

    def step(self, rng: random.Random) -> None:
        s = self.s
        out = s.schedule()
        check_blocks(s)
        assert not out.finished_req_ids & self.done.released
        self.done.released |= out.finished_req_ids
        # A request samples when its computed tokens reach its known ones (+1: a placeholder's token).
        scheduled = {rid: s.requests[rid] for rid in out.num_scheduled_tokens}
        samples = [rid for rid, r in scheduled.items() if r.num_computed_tokens >= r.num_tokens]
        flight = Flight(out, samples, scheduled)
        previous, self.in_flight = self.in_flight, None
        report = self._finish(previous, rng) if previous is not None else None
        self.runner.apply(out)  # launched (or run at once when empty): its diffs reach the runner
        if out.total_num_scheduled_tokens:
            self.in_flight = flight
        if previous is not None:
            self._update(previous, report, rng)
        if out.total_num_scheduled_tokens:
            # Step k+1's forward, checked after k's outputs: they touch no page, and a placeholder's
            # token (filled in by the runner when it arrives) is in the request's tokens by then.
            self._forward(flight)
        else:
            self._update(flight, self._finish(flight, rng), rng)

    def _finish(self, flight: Flight, rng: random.Random) -> ConnectorOutput | None:
        """After the step's forward: its saves are read out of the pool; loads that ended are reported."""
        if self.disk is None:
            return None
        meta = flight.out.kv_connector_metadata
        self.disk.save(meta, self.runner)
        return self.disk.finish(meta, self.runner, rng)

    def _forward(self, flight: Flight) -> None:
        s, runner, out = self.s, self.runner, flight.out
        assert out.total_num_scheduled_tokens <= self.cfg.max_num_batched_tokens
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        runner.forward(s, out, flight.requests)
        for rid in out.num_scheduled_tokens:
            if rid in s.requests and s.requests[rid].status is RequestStatus.RUNNING:
                check_tables_match(s, runner, rid)

    def _update(self, flight: Flight, report: ConnectorOutput | None, rng: random.Random) -> None:
        sampled = {rid: [EOS if rng.random() < 0.1 else rng.randrange(3, 50)] for rid in flight.samples}
        for o in self.s.update_from_output(flight.out, ModelRunnerOutput(sampled, kv_connector_output=report)):
            if o.finished:
                assert o.request_id not in self.done.reported
                self.done.reported[o.request_id] = o.finish_reason
        check_blocks(self.s)
        check_requests(self.s, self.cfg)

    @property
    def busy(self) -> bool:
        return self.in_flight is not None or self.s.has_unfinished_requests()


def run(cfg_kwargs: dict[str, Any], extra_blocks: int, groups: str, ops: list[tuple[Any, ...]]) -> None:
    cfg = EngineConfig(**cfg_kwargs)
    specs = GROUPS[groups]
    per_request = (MAX_MODEL_LEN // BS) * len(specs or [0]) + 1
    s = Scheduler(cfg, per_request + extra_blocks, MAX_MODEL_LEN, kv_groups=specs)
    s.lookahead = True
    disk = None
    if groups in DISK_MODES and cfg.enable_prefix_caching:
        index = MemoryIndex()
        needs = group_needs(specs or [FullAttention()])
        s.set_connector(DiskConnectorScheduler(index, StoreNamespace("m", block_size=BS), s.kv.chain_hashes, needs))
        disk = FakeDiskWorker(index)
    engine = PipelinedEngine(s, cfg, FakeRunner(specs or [FullAttention()]), disk)
    rng = random.Random(0)
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            s.add_request(make_request(len(added), op, rng))
            added.append(f"r{len(added)}")
        elif op[0] == "step":
            rng.seed(op[1])
            engine.step(rng)
        elif op[0] == "pressure":
            evict_free_cached(s)
        elif op[0] == "lose":
            if disk is not None and disk.index.stored:
                keys = sorted(disk.index.stored)
                del disk.index.stored[keys[op[1] % len(keys)]]
        elif added:
            rid = added[op[1] % len(added)]
            if op[0] == "abort":
                s.abort_requests([rid])
            else:
                s.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
    for _ in range(2000):
        if not engine.busy:
            break
        engine.step(rng)
    assert not engine.busy
    assert set(engine.done.reported) | engine.done.released == set(added)
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks
    assert group_tables(s) == {}
    event(f"placeholders: {s.num_placeholders > 0}")
    event(f"preempted: {s.num_preemptions > 0}")
    if disk is not None:
        stats = s.make_stats().connector
        event(f"disk hits ({groups}): {stats is not None and stats.hits > 0}")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg_kwargs=configs, extra_blocks=st.integers(0, 4), groups=st.sampled_from([*GROUPS, *DISK_MODES]), ops=ops)
def test_async_scheduling_keeps_invariants(
    cfg_kwargs: dict[str, Any], extra_blocks: int, groups: str, ops: list[tuple[Any, ...]]
) -> None:
    run(cfg_kwargs, extra_blocks, groups, ops)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg_kwargs=configs.map(lambda c: {**c, "enable_prefix_caching": True}),
    extra_blocks=st.integers(0, 4),
    groups=st.sampled_from(DISK_MODES),
    ops=disk_ops,
)
def test_async_scheduling_with_disk_loads_keeps_invariants(
    cfg_kwargs: dict[str, Any], extra_blocks: int, groups: str, ops: list[tuple[Any, ...]]
) -> None:
    run(cfg_kwargs, extra_blocks, groups, ops)
