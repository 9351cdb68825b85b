"""Bad arguments fail early with a message that names the problem."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from metalserve.kernels.metal.paged import PagedArgs, num_partitions
from tests.kernels.cases import CASES, make_inputs
from tests.kernels.test_emulator import COPY_OK
from tools.msl_emulator import EmulatorError, emulate


def args(**change: object) -> PagedArgs:
    case = CASES[0]
    x = make_inputs(case)
    base = dict(
        q=x.q,
        k_pool=x.k_pool,
        v_pool=x.v_pool,
        block_tables=x.block_tables,
        cu_seqlens_q=x.cu_seqlens_q,
        seq_lens=x.seq_lens,
        block_size=case.block_size,
        scale=x.scale,
        sliding_window=None,
        softcap=None,
        sinks=None,
    )
    base.update(change)
    return PagedArgs(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": mx.zeros((3, 8, 72))}, "head dim"),
        ({"q": mx.zeros((3, 7, 64))}, "multiple of KV heads"),
        ({"block_size": 12}, "block_size"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"softcap": 0.0}, "softcap"),
        ({"sinks": mx.zeros((3,))}, "sinks"),
        ({"cu_seqlens_q": mx.array([0, 1], mx.int32)}, "cu_seqlens_q"),
    ],
)
def test_bad_arguments_are_rejected(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        args(**change)


def test_pools_of_an_unsupported_dtype_are_rejected() -> None:
    a = args()
    with pytest.raises(ValueError, match="dtype"):
        args(k_pool=a.k_pool.astype(mx.int32), v_pool=a.v_pool.astype(mx.int32))


def test_split_is_chosen_from_static_shapes() -> None:
    a = args()
    context = a.block_tables.shape[1] * a.block_size
    assert num_partitions(a, None) == 1  # short contexts: one launch
    assert num_partitions(a, 16) == -(-context // 16)
    with pytest.raises(ValueError, match="partition_size"):
        num_partitions(a, 0)


def test_emulator_rejects_a_grid_that_is_not_whole_threadgroups() -> None:
    with pytest.raises(EmulatorError, match="multiple of the threadgroup size"):
        emulate(dataclasses.replace(COPY_OK, grid=(48, 1, 1)))
