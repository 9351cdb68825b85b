"""Rank 0's model runner: the first stage (embedding + its layers) runs and is sent on at `submit`; the
last rank's hidden rows come back at `complete`, where rank 0 applies the final norm and the vocabulary
projection and samples. Sampling stays next to the scheduler, so every sampling feature works as is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from metalserve.distributed.stage import embed_inputs, final_norm, run_layers
from metalserve.distributed.wire import (
    Header,
    Kind,
    StepMeta,
    as_hidden,
    pack_payload,
    recv_header,
    recv_payload,
    send_message,
)
from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.context import forward_context
from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.logprobs import prompt_logprobs
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.runner import ModelRunner, SamplerFn
from metalserve.executor.step_inputs import StepInputs, pack_step
from metalserve.kvcache.specs import KVCacheSpec
from metalserve.outputs import TokenLogprob
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput


class PipelineError(RuntimeError):
    """The pipeline broke: a rank answered out of order or with the wrong message."""


@dataclass
class InFlight:
    """One submitted step, until its rows come back."""

    so: SchedulerOutput
    step: StepInputs
    states: list[CachedRequestState]  # per packed request, as they were at submit
    sampling: list[CachedRequestState]
    step_id: int


class PipelineRunner(ModelRunner):
    """A ModelRunner over rank 0's layer slice whose forward is split in two (`submit`, `complete`)."""

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
        tensor_parallel: int = 1,
    ) -> None:
        super().__init__(model, spec, eos_token_ids=eos_token_ids, sampler=sampler, backend=backend)
        self.group = group
        self.tensor_parallel = tensor_parallel  # ranks per stage: rank 0's stage partners are 1..tp-1
        self.last_rank = group.size() - 1
        self._next_id = 0
        # The activations' dtype (the last rank's rows come back in it); a slice may keep no K/V pages.
        self.dtype = model.family.activation_dtype(model.model)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        flight = self.submit(so)
        return ModelRunnerOutput(sampled_token_ids={}) if flight is None else self.complete(flight)

    def submit(self, so: SchedulerOutput) -> InFlight | None:
        """Apply the step's diffs, run the first stage and send it to rank 1; None for an empty step."""
        if so.num_kv_blocks > self.spec.num_blocks:
            self.grow_kv(so.num_kv_blocks)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return None
        step = pack_step(self.requests, so.num_scheduled_tokens, self.spec.block_size)
        tables = self.block_tables
        others = tuple([tables[rid].array(g) for rid in step.request_ids] for g in range(1, tables.num_groups))
        meta, width = StepMeta.from_step(step, others).encode()
        inputs = embed_inputs(self.model, mx.array(step.token_ids))
        if self.tensor_parallel > 1:
            # Rank 1 runs the same layers on its heads: it gets the step (and its inputs) first, passes
            # its own output on to the next stage, and the layers' all-reduces join the two here.
            mx.eval(inputs)
            self._send_step(step, meta, width, inputs, tables.num_groups)
        with forward_context(self._context(step)):
            hidden = run_layers(self.model, inputs)
        if self.tensor_parallel == 1:
            self._send_step(step, meta, width, hidden, tables.num_groups)
        mx.eval(hidden, self._kv_arrays())
        states = [self.requests[rid] for rid in step.request_ids]
        sampling = [states[i] for i in step.sampling_rows]
        self._next_id += 1
        return InFlight(so, step, states, sampling, self._next_id - 1)

    def _send_step(self, step: StepInputs, meta: np.ndarray, width: int, hidden: mx.array, num_tables: int) -> None:
        payload = pack_payload(meta, hidden)
        assert payload is not None
        header = Header(
            Kind.STEP,
            len(step.token_ids),
            len(step.request_ids),
            len(step.logits_indices),
            width,
            self.spec.num_blocks,
            self._next_id,
            payload.nbytes,
            num_tables,
        )
        send_message(header, payload, 1, self.group)

    def complete(self, flight: InFlight) -> ModelRunnerOutput:
        """Receive the step's sampling rows from the last rank, project them and sample."""
        header = recv_header(self.last_rank, self.group)
        if header.kind != Kind.RESULT or header.step_id != flight.step_id:
            raise PipelineError(f"expected the result of step {flight.step_id}, got {header}")
        payload = recv_payload(header, self.last_rank, self.group)
        sampled: dict[str, list[int]] = {rid: [] for rid in flight.step.request_ids}
        logprobs: dict[str, list[TokenLogprob]] = {}
        for i, state in enumerate(flight.states):
            if self.requests.get(state.request_id) is state:
                # A later step may already have moved it further (its next prefill chunk): never go back.
                state.num_computed_tokens = max(state.num_computed_tokens, int(flight.step.seq_lens[i]))
        prompt: dict[str, tuple[int, list[TokenLogprob]]] = {}
        if payload is not None and (flight.sampling or flight.step.prompt_rows):
            rows = as_hidden(payload, header.num_rows, self.dtype)
            logits = self.model.mlx_logits(final_norm(self.model, rows))
            if flight.step.prompt_rows:  # their rows follow the sampling rows
                prompt = prompt_logprobs(logits[flight.step.num_sampling_logits :], flight.step, self.requests)
                logits = logits[: flight.step.num_sampling_logits]
        if flight.sampling and payload is not None:
            result = self.sampler(logits, flight.sampling)
            for j, state in enumerate(flight.sampling):
                if self.requests.get(state.request_id) is not state:
                    continue  # preempted or finished by a later step: this token is stale
                token = result.token_ids[j]
                state.token_ids.append(token)
                sampled[state.request_id] = [token]
                lp = result.logprobs[j]
                if lp is not None:
                    logprobs[state.request_id] = [lp]
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt)
