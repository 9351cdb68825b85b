"""Rank 0's engine core with a batch queue (vLLM's virtual engines): step k+1 is scheduled and sent while
step k is still in the pipe, so every rank has work.

The scheduler is unchanged. Its rule already keeps a decoding request out of the next step until its
token is back (its last token is scheduled but not sampled: no new tokens to schedule). A prompt's next
chunk may go while the previous chunk is in the pipe: every rank runs steps in order, so its K/V is
written before the next chunk reads it. A request preempted or finished by a later step drops the stale
token of the earlier one (rank0.py).
"""

from __future__ import annotations

import time
from collections import deque

from metalserve.distributed.rank0 import InFlight, PipelineRunner
from metalserve.distributed.wire import Header, Kind, send_message
from metalserve.engine.core import GRAMMAR_POLL_S, EngineCore
from metalserve.outputs import EngineCoreOutput
from metalserve.scheduler.output import ModelRunnerOutput
from metalserve.scheduler.scheduler import Scheduler

_EMPTY = ModelRunnerOutput(sampled_token_ids={})


class PipelineEngineCore(EngineCore):
    """EngineCore whose `step` keeps up to `depth` steps in flight through the ranks."""

    runner: PipelineRunner

    def __init__(self, scheduler: Scheduler, runner: PipelineRunner, max_model_len: int, depth: int = 2) -> None:
        super().__init__(scheduler, runner, max_model_len)
        self.depth = depth
        self.queue: deque[InFlight] = deque()
        self.waiting_since: float | None = None  # when rank 0 began waiting for a result (watchdog)
        self.stopped = False
        self.failed = False  # a step raised (a rank went away): the pipeline cannot be stopped in order

    def step(self) -> list[EngineCoreOutput]:
        try:
            return self._step()
        except BaseException:
            self.failed = True
            raise

    def _step(self) -> list[EngineCoreOutput]:
        """Schedule and send one step if there is room; else (or when nothing new can run) finish the
        oldest step in flight. Returns the outputs of whatever finished."""
        self.check_thread()
        outputs: list[EngineCoreOutput] = []
        if len(self.queue) < self.depth:
            so = self.scheduler.schedule()
            flight = self.runner.submit(so)
            if flight is None:
                outputs += self.scheduler.update_from_output(so, _EMPTY)
                if not self.queue and self.scheduler.num_waiting_for_grammar:
                    time.sleep(GRAMMAR_POLL_S)
            else:
                self.queue.append(flight)
                if len(self.queue) < self.depth:
                    return outputs  # room for one more: schedule again before waiting
        if self.queue:
            flight = self.queue.popleft()
            self.waiting_since = time.monotonic()
            try:
                result = self.runner.complete(flight)
            finally:
                self.waiting_since = None
            outputs += self.scheduler.update_from_output(flight.so, result)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.queue) or self.scheduler.has_unfinished_requests()

    def stop_pipeline(self) -> None:
        """Tell the other ranks to exit (an orderly shutdown); at most once."""
        if self.stopped:
            return
        self.stopped = True
        send_message(Header(Kind.STOP, 0, 0, 0, 0, 0, -1, 0), None, 1, self.runner.group)
