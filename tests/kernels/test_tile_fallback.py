"""Tiles sized to a register budget that holds at head dim 128 and 256, and a launch the device refuses
falling back to the next smaller tile, then to MLX ops: once, with one warning, the request served.

The refusing device is a fake executor: it raises MLX's kind of error for threadgroups above a limit
and runs the rest under the CPU emulator (the exact MSL that Metal compiles).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from metalserve.kernels.metal.guard import LaunchGuard, LaunchRefused
from metalserve.kernels.metal.launch import KernelLaunch
from metalserve.kernels.metal.paged import HEAD_DIMS, run_paged_attention
from metalserve.kernels.metal.tiled import (
    BUDGET_SHARE,
    REGISTER_BUDGET,
    THREADGROUP_MEMORY,
    max_threads,
    registers_per_thread,
    threadgroup_bytes,
    tile_ladder,
    tiled_launch,
    tiling,
)
from tests.kernels.cases import TOLERANCE, Case, as_f64, make_inputs, reference_f64
from tests.kernels.test_paged_attention import paged_args
from tools.msl_emulator import emulate

GROUPS = range(1, 129)


def _threads(launch: KernelLaunch) -> int:
    return launch.threadgroup[0] * launch.threadgroup[1] * launch.threadgroup[2]


class RefusingDevice:
    """Runs launches of at most `limit` threads under the emulator; refuses larger ones as MLX would."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[int] = []  # threads of every launch that reached the device

    def __call__(self, launch: KernelLaunch) -> list[mx.array]:
        self.calls.append(_threads(launch))
        if _threads(launch) > self.limit:
            raise refusal(_threads(launch), self.limit)
        return emulate(launch)


def refusal(threads: int, limit: int) -> ValueError:
    """MLX's own error for a threadgroup above the pipeline's limit (mlx/backend/metal/custom_kernel.cpp)."""
    return ValueError(
        f"Thread group size ({threads}) is greater than  the maximum allowed threads per threadgroup ({limit})."
    )


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_tile_stays_within_the_register_budget_and_threadgroup_memory(head_dim: int) -> None:
    for group in GROUPS:
        ladder = tile_ladder(group, head_dim)
        assert (tiling(group, head_dim) is None) == (not ladder)
        for t in ladder:
            assert t.threads <= max_threads(head_dim) and t.rows % 8 == 0 and t.tile_q * group <= t.rows
            assert t.threads * registers_per_thread(head_dim, t.key_tile) <= REGISTER_BUDGET * BUDGET_SHARE
            assert threadgroup_bytes(head_dim, t.rows, t.key_tile) <= THREADGROUP_MEMORY
        for larger, smaller in zip(ladder, ladder[1:], strict=False):  # halves, or the one-token tile
            assert smaller.threads <= larger.threads // 2 or smaller.rows == ladder[-1].rows
        if ladder:  # down to the smallest tile that holds one token's G rows
            assert ladder[-1].rows == -(-group // 8) * 8


def test_head_dim_128_and_256_launch_at_most_256_threads() -> None:
    """The issue's case: G 4-8 at head dim 128 took 512-thread threadgroups (Llama, Mistral, Qwen)."""
    assert {d: max_threads(d) for d in HEAD_DIMS} == {64: 512, 80: 512, 96: 512, 128: 256, 256: 256}
    for group in (4, 5, 8):
        t = tiling(group, 128)
        assert t is not None and t.threads == 256


# The issue's shape (G 4 at head dim 128) and head dim 256 in the default run; the other head dims'
# extreme tiles (the most threadgroup memory, the most threads) are slow: each is two g++ builds cold.
DEFAULT_EMULATED = ((128, 4), (256, 2))


def _extreme_cases() -> list[tuple[int, int]]:
    """(head dim, G) whose tile is the largest in threadgroup memory or in threads for its head dim, over
    the GQA ratios models use."""
    picks = set()
    for d in HEAD_DIMS:
        options = [(g, t) for g in (1, 2, 4, 8) for t in tile_ladder(g, d)]
        picks.add((d, max(options, key=lambda o: threadgroup_bytes(d, o[1].rows, o[1].key_tile))[0]))
        picks.add((d, max(options, key=lambda o: o[1].threads)[0]))
    return sorted(picks - set(DEFAULT_EMULATED))


def _case(head_dim: int, group: int) -> Case:
    t = tiling(group, head_dim)
    assert t is not None
    return Case(
        f"d{head_dim}_g{group}",
        ((t.tile_q + 3, t.tile_q + 10), (2, 9)),
        head_dim=head_dim,
        num_q_heads=group,
        num_kv_heads=1,
    )


def warm_launches() -> list[KernelLaunch]:
    """Every tile of the default-run cases, for conftest.py's parallel warm-up of the emulator."""
    out = []
    for head_dim, group in DEFAULT_EMULATED:
        case = _case(head_dim, group)
        args = paged_args(case, make_inputs(case))
        out += [tiled_launch(args, t) for t in tile_ladder(group, head_dim)]
    return out


@pytest.mark.parametrize(
    ("head_dim", "group"),
    [*DEFAULT_EMULATED, *(pytest.param(d, g, marks=pytest.mark.slow) for d, g in _extreme_cases())],
)
def test_the_emulator_runs_both_tiles_of_the_ladder(head_dim: int, group: int) -> None:
    """Under the emulator (which fails any threadgroup over 32 KiB or 1024 threads), the first tile and
    the fallback tile both give the reference's answer."""
    t = tiling(group, head_dim)
    assert t is not None
    case = _case(head_dim, group)
    x = make_inputs(case)
    want = reference_f64(case, x)
    for limit in (t.threads, t.threads // 2):  # the first tile; the device refuses it: the smaller one
        device = RefusingDevice(limit)
        out = run_paged_attention(paged_args(case, x), LaunchGuard(device), None, "tiled")
        assert device.calls[-1] == min(limit, t.threads)
        np.testing.assert_allclose(as_f64(out), want, atol=TOLERANCE[case.dtype], rtol=0)


def test_a_refused_tile_falls_back_to_the_next_smaller_once_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    case = Case("fallback", ((20, 30), (3, 3)), head_dim=128, num_q_heads=8, num_kv_heads=2)
    x = make_inputs(case)
    device = RefusingDevice(limit=128)
    guard = LaunchGuard(device)
    with caplog.at_level(logging.WARNING, logger="metalserve.kernels"):
        first = run_paged_attention(paged_args(case, x), guard, None, "auto")
        again = run_paged_attention(paged_args(case, x), guard, None, "auto")
    assert device.calls == [256, 128, 128]  # the refused tile reached the device once
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "256-thread" in warnings[0] and "128-thread tiles run instead" in warnings[0]
    for out in (first, again):
        np.testing.assert_allclose(as_f64(out), reference_f64(case, x), atol=TOLERANCE[case.dtype], rtol=0)


def test_when_every_tile_is_refused_the_caller_is_told_once() -> None:
    case = Case("refused", ((20, 30),), head_dim=128, num_q_heads=8, num_kv_heads=2)
    x = make_inputs(case)
    device = RefusingDevice(limit=0)
    guard = LaunchGuard(device)
    with pytest.raises(LaunchRefused) as first:
        run_paged_attention(paged_args(case, x), guard, None, "auto")
    with pytest.raises(LaunchRefused) as again:
        run_paged_attention(paged_args(case, x), guard, None, "auto")
    assert first.value.first and not again.value.first
    assert device.calls == [256, 128, 64, 32, 128]  # every tile, then the decode kernel; never tried again


def test_a_gpu_that_refuses_every_launch_still_serves_mlx_lm_s_tokens(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the real engine: the Metal backend whose every launch (tiled, decode) is refused runs its
    attention on MLX ops; a prefill and decodes are served, with one warning."""
    from metalserve.executor.attention.metal import KernelAttention
    from metalserve.kernels.metal.paged import PagedArgs
    from metalserve.serving import build as core
    from tests.models import golden
    from tests.models.archs import VOCAB, build

    device = RefusingDevice(limit=0)
    guard = LaunchGuard(device)

    def refused_kernel(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        tables: mx.array,
        cu: mx.array,
        lens: mx.array,
        *,
        block_size: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        args = PagedArgs(q, k, v, tables, cu, lens, block_size, scale, sliding_window, softcap, sinks)
        return run_paged_attention(args, guard)

    backend = KernelAttention(refused_kernel, "metal", "the Metal kernel on a GPU that refuses it")
    monkeypatch.setattr(core, "select_attention", lambda *args, **kwargs: backend)
    short, long = golden.prompts([golden.SHORT, 40], VOCAB, seed=2)
    want = [golden.reference(build("llama", head_dim=64), p) for p in (short, long)]
    with caplog.at_level(logging.WARNING, logger="metalserve.engine"):
        got = golden.serve(golden.engine(build("llama", head_dim=64), budget=32), [short, long])
    for g, w in zip(got, want, strict=True):
        golden.check(g, w)
    assert {256, 128} <= set(device.calls)  # both tiles were tried (and the decode kernel's 128 threads)
    refusals = [r for r in caplog.records if "MLX ops run the attention" in r.getMessage()]
    assert len(refusals) == 1 and len(device.calls) == len(guard.refused)  # each refused once


def test_the_mac_tile_record_marks_what_the_device_refused() -> None:
    """tools/record_tile_acceptance.py's table, on a fake device that takes up to 256 threads."""
    from tools.record_tile_acceptance import probe

    def zeros_up_to_256(launch: KernelLaunch) -> list[mx.array]:
        if _threads(launch) > 256:
            raise refusal(_threads(launch), 256)
        return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes, strict=True)]

    rows = probe(zeros_up_to_256)
    assert {r["head_dim"] for r in rows} == set(HEAD_DIMS) and {r["threads"] for r in rows} == {128, 256, 512}
    assert all(r["accepted"] == (r["threads"] <= 256) for r in rows)
    assert all("Thread group size" in r["error"] for r in rows if not r["accepted"])
    # The planned tiles at head dim 128 and 256 are all within 256 threads: a GPU like this one takes them.
    assert all(r["accepted"] for r in rows if r["planned"] and r["head_dim"] >= 128)
