"""The runner's own per-request state (a persistent batch): a step sends only diffs for known requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metalserve.executor.block_table import PACKED_GROUP, RequestBlockTable
from metalserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]  # prompt + every output token so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    blocks: RequestBlockTable  # its row of the runner's one block table (every layer group's ids)
    num_computed_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    structured: Any = None  # the request's GrammarState (metalserve/structured/state.py), if any
    mm_inputs: list[Any] = field(default_factory=list)  # its images (multimodal/inputs.py: MultiModalInput)
    # M-RoPE models: the prompt's positions [3, num_prompt_tokens] and the delta later tokens add to their index.
    mrope: tuple[np.ndarray, int] | None = None
    lora_slot: int = -1  # its LoRA adapter's slot in the model (lora/layers.py: LoraSlots); -1: the base model
    lora_scale: float = 1.0  # the request's multiplier of its adapter's delta (its `lora_scale`)

    @property
    def wants_pooling(self) -> bool:
        """A pooling request (sampling_params.pooling): its rows are pooled, nothing is sampled."""
        return self.sampling_params.pooling is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Without copying the outputs (the sampler asks every step)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def block_ids(self) -> list[int]:
        """Its ids in the group a step is packed through (block_table.py), where a draft model's KV goes too."""
        return self.blocks.ids[PACKED_GROUP]

    @property
    def block_array(self) -> np.ndarray:
        """`block_ids` as an int64 array, rebuilt only when blocks were added."""
        return self.blocks.array(PACKED_GROUP)
