"""Tensor parallelism's steps: rank 0 schedules and samples, every rank runs the same packed step on its
own heads and columns (shard.py), and the layers' all-reduces join the ranks inside the forward.

Once per step rank 0 broadcasts the step's inputs (wire.py's header, then the token ids and the packed
metadata as one int32 vector); the other ranks build the same attention metadata from them, grow their
pools to the same size and run the same forward. Rank 0 alone applies the vocabulary projection and
samples. The broadcast is an all-reduce of rank 0's values with the others' zeros: MLX's distributed
API has no broadcast, and an all-reduce reaches every rank over any backend (ring, JACCL) and group size.

Every rank must issue the same collectives in the same order: the step's two broadcasts, then two
all-reduces per layer. So steps run one at a time (no async scheduling) and a rank evaluates the whole
forward, not only its pools.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx
import numpy as np

from metalserve.distributed.stage import Stage
from metalserve.distributed.wire import HEADER_LEN, Header, Kind, StepMeta
from metalserve.engine.core import EngineCore
from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.context import ForwardContext, forward_context
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.compute import MlxCompute, MlxForward
from metalserve.executor.runner import InFlightStep, ModelRunner, SamplerFn
from metalserve.executor.step_inputs import StepInputs
from metalserve.kvcache.specs import KVCacheSpec
from metalserve.outputs import EngineCoreOutput
from metalserve.scheduler.output import ModelRunnerOutput

logger = logging.getLogger("metalserve.distributed")


def broadcast(values: mx.array | None, shape: tuple[int, ...], group: mx.distributed.Group) -> mx.array:
    """Rank 0's int32 `values` on every rank (the others pass None)."""
    mine = values if values is not None else mx.zeros(shape, mx.int32)
    out = mx.distributed.all_sum(mine, group=group)
    mx.eval(out)
    return out


def encode_step(step: StepInputs, group_rows: tuple[list[np.ndarray], ...] = ()) -> tuple[np.ndarray, int]:
    """The step as one int32 vector (token ids, then wire.py's metadata with every other layer group's
    tables: sliding windows, recurrent states) and its block-table width."""
    meta, width = StepMeta.from_step(step, group_rows).encode()
    return np.concatenate([np.asarray(step.token_ids, np.int32), meta]), width


def decode_step(flat: np.ndarray, header: Header) -> tuple[np.ndarray, StepMeta]:
    """(token ids, the step's metadata)."""
    t = header.num_tokens
    return flat[:t], StepMeta.decode(flat[t:], header)


def send_step(header: Header, flat: np.ndarray | None, group: mx.distributed.Group) -> None:
    """Rank 0: the header, then (for a step) its inputs."""
    broadcast(header.array(), (HEADER_LEN,), group)
    if flat is not None and flat.size:
        broadcast(mx.array(flat), flat.shape, group)


def receive_step(group: mx.distributed.Group) -> tuple[Header, np.ndarray]:
    """Ranks 1..N-1: the next header and its int32 inputs (empty for STOP)."""
    values: list[int] = np.array(broadcast(None, (HEADER_LEN,), group)).tolist()
    header = Header(*values)
    if header.kind != Kind.STEP or header.payload_bytes == 0:
        return header, np.zeros(0, np.int32)
    return header, np.array(broadcast(None, (header.payload_bytes // 4,), group))


class WholeForward(MlxCompute):
    """The all-MLX forward, keeping the step's final hidden states: a step whose rows sample nothing (a
    prefill chunk) needs no logits, and its pools alone do not need the last layer's all-reduces, which
    the other ranks run all the same. Rank 0 evaluates them (`TensorParallelRunner.finish`)."""

    def __init__(self) -> None:
        self.hidden: mx.array | None = None

    def forward(self, model: MlxForward, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        self.hidden = model.mlx_hidden_states(mx.array(token_ids))
        return model.mlx_logits(self.hidden[mx.array(logits_indices)])


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: the ordinary runner, whose every forward first sends the step to the other ranks
    and is evaluated to its last layer (its model computes with `WholeForward`)."""

    shrinks_kv = False  # the other ranks size their pools from rank 0's block count and only grow

    def __init__(
        self,
        model: PagedModel,
        spec: KVCacheSpec,
        group: mx.distributed.Group,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        sampler: SamplerFn | None = None,
        backend: AttentionBackend[Any, Any],
    ) -> None:
        super().__init__(model, spec, eos_token_ids=eos_token_ids, sampler=sampler, backend=backend)
        self.group = group
        self._next_id = 0
        if not isinstance(model.compute, WholeForward):
            raise TypeError("a tensor-parallel rank 0 computes with WholeForward")
        self.whole = model.compute

    def finish(self, flight: InFlightStep) -> ModelRunnerOutput:
        if self.whole.hidden is not None:
            hidden, self.whole.hidden = self.whole.hidden, None
            mx.eval(hidden)
        return super().finish(flight)

    def _context(self, step: StepInputs) -> ForwardContext:
        # Called once per step with tokens, right before the forward is built: the one place to send it.
        tables = self.block_tables
        others = tuple([tables[rid].array(g) for rid in step.request_ids] for g in range(1, tables.num_groups))
        flat, width = encode_step(step, others)
        header = Header(
            Kind.STEP,
            len(step.token_ids),
            len(step.request_ids),
            len(step.logits_indices),
            width,
            self.spec.num_blocks,
            self._next_id,
            flat.nbytes,
            tables.num_groups,
        )
        send_step(header, flat, self.group)
        self._next_id += 1
        return super()._context(step)


class TensorParallelCore(EngineCore):
    """Rank 0's EngineCore: synchronous steps, with what the watchdog and the shutdown read."""

    runner: TensorParallelRunner

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting_since: float | None = None  # when the step in progress began (the watchdog's timeout)
        self.stopped = False
        self.failed = False  # a step raised (a rank went away): no orderly STOP can be sent

    def step(self) -> list[EngineCoreOutput]:
        self.waiting_since = time.monotonic()
        try:
            return super().step()
        except BaseException:
            self.failed = True
            raise
        finally:
            self.waiting_since = None

    def stop_pipeline(self) -> None:
        """Tell the other ranks to exit (an orderly shutdown); at most once."""
        if self.stopped:
            return
        self.stopped = True
        send_step(Header(Kind.STOP, 0, 0, 0, 0, 0, -1, 0), None, self.runner.group)


class TensorParallelWorker:
    """Ranks 1..N-1: no scheduler, no sampler; this rank's heads of every layer and their KV pools."""

    def __init__(self, stage: Stage, group: mx.distributed.Group) -> None:
        self.stage = stage
        self.group = group
        self.steps = 0

    def serve(self) -> None:
        """Run steps until rank 0 broadcasts STOP."""
        while True:
            header, flat = receive_step(self.group)
            if header.kind == Kind.STOP:
                return
            if header.kind != Kind.STEP:
                raise RuntimeError(f"tensor-parallel rank {self.group.rank()}: unexpected message {header}")
            self.run_step(header, flat)

    def run_step(self, header: Header, flat: np.ndarray) -> None:
        token_ids, meta = decode_step(flat, header)
        self.stage.ensure_blocks(header.num_kv_blocks)
        # Every layer group's metadata and the recurrent states' plan, as a pipeline stage builds them:
        # this rank holds every layer, with its own heads' pages and states.
        with forward_context(self.stage.context(meta)):
            hidden = self.stage.model.mlx_hidden_states(mx.array(token_ids))
        # The whole forward, not only the pools: the last layer's all-reduce feeds no pool but rank 0 waits on it.
        mx.eval(hidden, self.stage.pools())
        self.steps += 1
