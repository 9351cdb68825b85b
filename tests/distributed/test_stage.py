"""A model cut into two stages in one process (no ring) computes what the whole model computes: the
slices keep their own KV pools under shared block ids, and a pool that grows keeps its contents."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.distributed.stage import Stage, keep_layers, run_layers
from metalserve.distributed.wire import StepMeta
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.context import forward_context
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.compute import MlxCompute
from metalserve.kvcache.specs import KVCacheDtype, KVCacheSpec
from tests.executor.tiny_models import tiny_model


def _meta(positions: list[int], blocks: list[int], bs: int) -> StepMeta:
    pos = np.asarray(positions, np.int32)
    rows = np.asarray(blocks)
    slots = (rows[pos // bs] * bs + pos % bs).astype(np.int32)
    return StepMeta(
        pos,
        slots,
        np.array([0, len(pos)], np.int32),
        np.array([pos[-1] + 1], np.int32),
        [rows],
        np.array([len(pos) - 1], np.int32),
    )


def _stage(layers: range, first: bool, blocks: int, storage: KVCacheDtype = "auto") -> Stage:
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    keep_layers(model, layers, first)
    spec = KVCacheSpec.uniform(len(layers), 2, 16, "float32", 4, 8, blocks, storage)
    return Stage(PagedModel(model, "llama", MlxCompute()), spec, MlxAttention())


def _two_stage_logits(first: Stage, second: Stage, tokens: list[int], meta: StepMeta) -> mx.array:
    with forward_context(first.context(meta)):
        h = run_layers(first.model, first.model.backbone.embed_tokens(mx.array(tokens)[None])[0])
    out = second.forward(h, meta)[mx.array(meta.logits_indices)]
    return first.model.mlx_logits(first.model.backbone.norm(out))


@pytest.mark.parametrize("storage", ["auto", "int8"])
def test_two_stages_equal_the_whole_model_across_a_pool_growth(storage: KVCacheDtype) -> None:
    """Also on int8 pages: each stage quantizes its own layers' K/V exactly as the whole model does."""
    whole = _stage(range(0, 4), True, 4, storage)
    first, second = _stage(range(0, 1), True, 4, storage), _stage(range(1, 4), False, 4, storage)
    prompt, blocks = [5, 9, 2, 7, 1, 3, 8, 4, 6, 11], [3, 1]
    meta = _meta(list(range(10)), blocks, 8)
    expected = _two_stage_logits(whole, _stage(range(4, 4), False, 4), prompt, meta)
    assert mx.allclose(_two_stage_logits(first, second, prompt, meta), expected, atol=1e-4)
    for stage in (whole, first, second):
        stage.ensure_blocks(6)  # the scheduler grew the pool; block 3 and 1 must keep their K/V
    decode = _meta([10], blocks, 8)
    expected = _two_stage_logits(whole, _stage(range(4, 4), False, 6), [12], decode)
    assert second.spec.num_blocks == 6 and second.kv[0].pool.shape[2] == 6 * 8
    assert second.spec.page.storage == storage
    assert mx.allclose(_two_stage_logits(first, second, [12], decode), expected, atol=1e-4)
