"""Ranks 1..N-1: receive a step (metadata + activations), run this slice's layers, pass them on; the
last rank sends the sampling rows back to rank 0. No scheduler, no request state: only KV pools."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import NamedTuple

import mlx.core as mx

from metalserve.distributed.setup import RankSetup, stage_spec
from metalserve.distributed.stage import Stage
from metalserve.distributed.wire import (
    Header,
    Kind,
    StepMeta,
    as_hidden,
    pack_payload,
    recv_header,
    recv_payload,
    send_message,
    split_payload,
)
from metalserve.kvcache.specs import KVCacheDtype

logger = logging.getLogger("metalserve.distributed")


class StepTimes(NamedTuple):
    recv_s: float  # waiting for and receiving the step
    compute_s: float
    send_s: float
    bytes_in: int
    bytes_out: int


class Worker:
    """One middle or last rank of the pipeline."""

    def __init__(self, stage: Stage, group: mx.distributed.Group, dtype: mx.Dtype, tensor_parallel: int = 1) -> None:
        self.stage = stage
        self.group = group
        self.rank = group.rank()
        self.last = self.rank == group.size() - 1
        # A stage of several tensor-parallel ranks (world ranks stage * tp + t): all but its last relay the
        # step they receive to the next rank of the stage before running it (the layers' all-reduces need
        # every rank of the stage); the stage's last rank sends its output on, as a lone stage does.
        self.relay = (self.rank + 1) % tensor_parallel != 0
        self.dtype = dtype
        self.times: deque[StepTimes] = deque(maxlen=1024)  # the latest steps, summarised at the end

    def serve(self) -> None:
        """Run steps until rank 0 sends STOP (passed on down the pipeline)."""
        while True:
            t0 = time.perf_counter()
            header = recv_header(self.rank - 1, self.group)
            if header.kind == Kind.STOP:
                if not self.last:
                    send_message(header, None, self.rank + 1, self.group)
                return
            self.run_step(header, t0)

    def run_step(self, header: Header, t0: float) -> None:
        payload = recv_payload(header, self.rank - 1, self.group)
        flat, raw = split_payload(payload, header, with_meta=True)
        assert flat is not None
        meta = StepMeta.decode(flat, header)
        self.stage.ensure_blocks(header.num_kv_blocks)
        if self.relay:
            send_message(header, payload, self.rank + 1, self.group)
        t1 = time.perf_counter()
        out = self.stage.forward(as_hidden(raw, header.num_tokens, self.dtype), meta)
        if self.relay:
            mx.eval(out, self.stage.pools())
            self.times.append(StepTimes(t1 - t0, time.perf_counter() - t1, 0.0, header.payload_bytes, 0))
            return
        if self.last:
            rows = out[mx.array(meta.logits_indices)] if header.num_rows else None
            mx.eval([rows] if rows is not None else [], self.stage.pools())
            result = pack_payload(None, rows)
            reply = header._replace(kind=Kind.RESULT, payload_bytes=0 if result is None else result.nbytes)
            dst = 0
        else:
            mx.eval(out, self.stage.pools())
            result = pack_payload(flat, out)
            reply, dst = header, self.rank + 1
        t2 = time.perf_counter()
        send_message(reply, result, dst, self.group)
        t3 = time.perf_counter()
        self.times.append(StepTimes(t1 - t0, t2 - t1, t3 - t2, header.payload_bytes, reply.payload_bytes))


def run_worker(
    setup: RankSetup,
    group: mx.distributed.Group,
    block_size: int,
    storage: KVCacheDtype = KVCacheDtype.AUTO,
    tensor_parallel: int = 1,
) -> None:
    spec = stage_spec(setup.model, block_size, storage, setup.initial_blocks)
    dtype = setup.model.family.activation_dtype(setup.model.model)
    worker = Worker(Stage(setup.model, spec, setup.backend), group, dtype, tensor_parallel)
    logger.info("pipeline rank %d ready: layers %d-%d", setup.rank, setup.layers.start, setup.layers.stop - 1)
    try:
        worker.serve()
    finally:
        logger.info("pipeline rank %d: %s", setup.rank, summary(list(worker.times)))
    logger.info("pipeline rank %d: stopped by rank 0", setup.rank)


def summary(times: list[StepTimes]) -> str:
    """Median seconds of the latest steps: waiting for and receiving a step, computing, sending."""
    if not times:
        return "no steps"
    med = [statistics.median(t[i] for t in times) * 1e3 for i in range(3)]
    return f"last {len(times)} steps, median ms: receive {med[0]:.2f}, compute {med[1]:.2f}, send {med[2]:.2f}"
