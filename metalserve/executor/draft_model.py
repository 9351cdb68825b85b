"""Draft-model proposals: a small model of the same vocabulary guesses the next tokens, batched. A
`Proposer` (spec_decode/proposer.py) that lives in the executor because it runs a model through a runner.

Its KV lives in pools of its own, indexed by the same block tables the KV manager hands the target
(one slot per token position), so the manager needs no second allocator. After each target step the
draft catches up on every request's new tokens in one packed forward (which also gives its first
guess), then runs one batched single-token forward per further guess. Its guesses are greedy: the
verifier keeps a draft only when it equals the target's own draw, so the output never depends on the
draft, only the speed does. Guesses stop at the slots the request holds (they are never allocated for
a guess); a request whose blocks do not yet hold its newest token catches up at a later step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx
import numpy as np

from metalserve.config import ConfigError
from metalserve.executor.attention.select import select_attention
from metalserve.executor.context import forward_context
from metalserve.executor.host import paged_model
from metalserve.executor.runner import ModelRunner
from metalserve.executor.step_inputs import pack_step
from metalserve.kvcache.specs import KVCacheDtype
from metalserve.spec_decode.proposer import DraftedRequest

if TYPE_CHECKING:
    from metalserve.executor.attention.base import AttentionBackend
    from metalserve.executor.models.adapter import PagedModel
    from metalserve.kvcache.specs import KVCacheSpec
    from metalserve.loader import LoadedModel
    from metalserve.platform import Platform


@dataclass
class _View:
    """What pack_step reads: the request's tokens (plus guesses so far) from the draft's own progress."""

    token_ids: list[int]
    num_computed_tokens: int
    block_array: np.ndarray
    wants_prompt_logprobs = False  # the draft's forwards report none
    wants_pooling = False  # nor pool
    num_prompt_tokens = 0  # read only for prompt logprobs
    mm_inputs: ClassVar[list[Any]] = []  # the draft runs without images


class DraftModelProposer:
    """Greedy drafts from a second, smaller model; see the module docstring."""

    def __init__(self, model: PagedModel, spec: KVCacheSpec, backend: AttentionBackend[Any, Any], k: int) -> None:
        # A runner of its own holds the draft's pools and builds its forward contexts; it never samples.
        self.runner = ModelRunner(model, spec, backend=backend)
        self.k = k
        self.computed: dict[str, int] = {}  # positions whose draft KV holds the request's real tokens

    @property
    def spec(self) -> KVCacheSpec:
        return self.runner.spec

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)

    def grow(self, num_blocks: int) -> None:
        self.runner.grow_kv(num_blocks)

    def truncate(self, num_blocks: int) -> None:
        self.runner.shrink_kv(num_blocks)

    def propose(self, requests: Sequence[DraftedRequest], limits: Mapping[str, int]) -> dict[str, list[int]]:
        bs = self.spec.block_size
        views: dict[str, _View] = {}
        room: dict[str, int] = {}
        for r in requests:
            rid, n = r.request_id, len(r.token_ids)
            capacity = len(r.block_ids) * bs
            k = limits.get(rid, 0)
            if capacity < n or not k:
                continue
            start = min(self.computed.get(rid, 0), n - 1)
            views[rid] = _View(list(r.token_ids), start, r.block_array)
            room[rid] = min(k, capacity - n + 1)  # guess j is fed back at position n + j - 1
        drafts: dict[str, list[int]] = {rid: [] for rid in views}
        todo = {rid: len(v.token_ids) - v.num_computed_tokens for rid, v in views.items()}
        while todo:
            guesses = self._forward(views, todo)
            for rid, token in guesses.items():
                view = views[rid]
                drafts[rid].append(token)
                view.num_computed_tokens = len(view.token_ids)
                view.token_ids.append(token)
            todo = {rid: 1 for rid in todo if len(drafts[rid]) < room[rid]}
        for r in requests:
            if r.request_id in views:
                self.computed[r.request_id] = len(r.token_ids)
        return {rid: d for rid, d in drafts.items() if d}

    def _forward(self, views: dict[str, _View], num_tokens: dict[str, int]) -> dict[str, int]:
        """One packed draft forward; the greedy next token of each request."""
        step = pack_step(views, num_tokens, self.spec.block_size)
        with forward_context(self.runner._context(step)):
            logits = self.runner.model(step.token_ids, step.logits_indices)
        tokens = np.array(mx.argmax(logits, axis=-1)).tolist()
        mx.eval(self.runner._kv_arrays())
        return {step.request_ids[i]: int(t) for i, t in zip(step.sampling_rows, tokens, strict=True)}


def build_draft_proposer(
    draft: LoadedModel,
    target_vocab: int,
    platform: Platform,
    attention: str,
    block_size: int,
    num_blocks: int,
    k: int,
    storage: KVCacheDtype = KVCacheDtype.AUTO,
) -> DraftModelProposer:
    """The draft model on the target's platform, with pools of `num_blocks` blocks stored as `storage`
    (the target's --kv-cache-dtype); same vocabulary only."""
    vocab = int(draft.model.args.vocab_size)
    if vocab != target_vocab:
        raise ConfigError(
            f"--speculative-config: the draft model's vocabulary ({vocab} tokens) differs from the target's "
            f"({target_vocab}); a draft must share the target's tokenizer"
        )
    model = paged_model(draft, platform)
    if len(model.kv_layout.groups) != 1 or model.state_layout is not None:
        raise ConfigError("--speculative-config: the draft model must be all full attention (one KV layer group)")
    spec = model.get_kv_cache_spec(model.family.page(draft.model, storage), block_size, num_blocks)
    dtype = model.family.activation_dtype(draft.model)
    heads = {t.head_dim for t in spec.tensors}
    backend = select_attention(attention, dtype, platform, heads, kv_storage=spec.page.storage)
    return DraftModelProposer(model, spec, backend, k)
