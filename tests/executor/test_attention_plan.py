"""The portable path's plan: single-query requests are bucketed by length, so one long context does not
make every short one attend over its length."""

from __future__ import annotations

import numpy as np

from metalserve.executor.attention.mlx_ops import build_plan


def plan_for(lens: list[int], block_size: int = 16):  # type: ignore[no-untyped-def]
    tables = [np.arange(i * 40, i * 40 + -(-n // block_size)) for i, n in enumerate(lens)]
    cu = np.arange(len(lens) + 1)
    return build_plan(tables, cu, np.array(lens), block_size, num_kv_heads=3)


def test_one_long_decode_gets_its_own_group() -> None:
    plan = plan_for([36, 36, 37, 40, 416])
    assert [(g.q_start, g.q_end) for g in plan.decodes] == [(0, 4), (4, 5)]
    assert [g.block_ids.shape for g in plan.decodes] == [(4, 3), (1, 26)]


def test_similar_lengths_share_one_group_with_a_mask_for_the_shorter() -> None:
    plan = plan_for([20, 30, 40])
    (group,) = plan.decodes
    assert group.block_ids.shape == (3, 3)
    assert group.mask is not None and group.mask.shape == (3 * 3, 1, 1, 48)
