"""What crosses the scheduler -> runner boundary each step, and what comes back.

New requests carry their full data; running ones only the diff. A preempted request is dropped by
the runner and, when it resumes, is sent again as a new request with all its tokens so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metalserve.kvcache.connector.base import ConnectorMetadata, ConnectorOutput
from metalserve.kvcache.manager import BlockIds
from metalserve.lora.request import LoraRequest
from metalserve.multimodal.inputs import MultiModalInput
from metalserve.outputs import TokenLogprob
from metalserve.request import StructuredState
from metalserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # the prompt, plus any output tokens already generated (a resumed request)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: BlockIds  # the request's table in every layer group (kvcache/manager.py)
    num_computed_tokens: int  # tokens already in the KV cache (prefix cache hit)
    structured: StructuredState | None = None  # the request's grammar (the sampler masks with it)
    mm_inputs: list[MultiModalInput] = field(default_factory=list)  # the prompt's images (placeholders, pixels)
    lora: LoraRequest | None = None  # the LoRA adapter the request runs under; None: the base model


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: BlockIds  # appended to the request's table in every layer group
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to run this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # finished or aborted since the last step
    preempted_req_ids: set[str] = field(default_factory=set)
    # Blocks the KV pool has grown to (0: unchanged); the runner grows its pools to match.
    num_kv_blocks: int = 0
    # Speculative decoding: the draft tokens scheduled after a request's last token (counted in
    # num_scheduled_tokens); the runner verifies them in this step's forward.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Images whose vision-tower output this step needs and the encoder cache lacks: request -> indices
    # into its mm_inputs (the runner encodes them before the forward).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Encoder outputs evicted from the encoder cache since the last step: the runner drops their arrays.
    free_encoder_mm_hashes: list[bytes] = field(default_factory=list)
    # A KV connector's loads and saves for this step (kvcache/connector/); None: nothing to move.
    kv_connector_metadata: ConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per scheduled request: the sampled token ids (empty while its prompt is still being prefilled;
    a verified window's accepted drafts and next token), and the drafts proposed for the next step."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_output: ConnectorOutput | None = None  # a KV connector's finished transfers
    # sampling_params.prompt_logprobs: (the first prompt position they are for, their logprobs) per request.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Pooling requests whose prompt this step finished: their pooled vector (or logit scores).
    pooled: dict[str, list[float]] = field(default_factory=dict)
