"""The launch ladder to its last rung, on a fake device that refuses threadgroups above 64 threads: every
tile from the largest down to the smallest, then the decode kernel, then (the caller) MLX ops. The guard
remembers only refusals of a launch's size or memory; any other error propagates and is tried again."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from metalserve.kernels.metal.guard import LaunchGuard, LaunchRefused, is_launch_refusal
from metalserve.kernels.metal.launch import KernelLaunch
from metalserve.kernels.metal.paged import run_paged_attention
from metalserve.kernels.metal.tiled import tile_ladder
from tests.kernels.cases import Case, make_inputs
from tests.kernels.test_paged_attention import paged_args
from tests.kernels.test_tile_fallback import refusal

LIMIT = 64


class SmallDevice:
    """Refuses threadgroups above LIMIT threads as MLX does; runs the rest as zeros (the rungs are what is
    tested here; tests/kernels/test_tile_fallback.py runs tiles under the emulator)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, launch: KernelLaunch) -> list[mx.array]:
        threads = launch.threadgroup[0] * launch.threadgroup[1] * launch.threadgroup[2]
        self.calls.append((launch.name, threads))
        if threads > LIMIT:
            raise refusal(threads, LIMIT)
        return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes, strict=True)]


def run(q_heads: int, kv_heads: int, head_dim: int, guard: LaunchGuard) -> mx.array:
    case = Case("ladder", ((20, 30), (3, 3)), head_dim=head_dim, num_q_heads=q_heads, num_kv_heads=kv_heads)
    return run_paged_attention(paged_args(case, make_inputs(case)), guard, None, "auto")


def test_the_default_models_shape_walks_every_tile_down_to_one_that_fits(caplog: pytest.LogCaptureFixture) -> None:
    """SmolLM2's shape (G 3, head dim 64): 384, 192, 96 threads refused; the 32-thread tile runs. Before,
    the ladder stopped after 384 and 192 and attention went to MLX ops."""
    assert [t.threads for t in tile_ladder(3, 64)] == [384, 192, 96, 32]
    device = SmallDevice()
    with caplog.at_level(logging.WARNING, logger="metalserve.kernels"):
        run(9, 3, 64, LaunchGuard(device))
    assert device.calls == [("paged_attention_tiled", n) for n in (384, 192, 96, 32)]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "384-thread" in warning and "96-thread" in warning and warning.endswith("32-thread tiles run instead")


def test_past_the_smallest_tile_the_decode_kernel_then_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    """G 24 (24 query heads on one KV head): the smallest tile still has 24 rows (96 threads) and the decode
    kernel 128 threads, so everything is refused and the caller (the backend's MLX ops) is told; with G 12
    the decode kernel is the rung that would run on a device taking 128 threads."""
    assert [t.threads for t in tile_ladder(24, 64)] == [480, 192, 96]
    device = SmallDevice()
    guard = LaunchGuard(device)
    with pytest.raises(LaunchRefused, match="paged_attention with 128-thread") as refused:
        run(24, 1, 64, guard)
    assert refused.value.first
    assert device.calls == [("paged_attention_tiled", n) for n in (480, 192, 96)] + [("paged_attention", 128)]
    with pytest.raises(LaunchRefused) as again:
        run(24, 1, 64, guard)
    assert not again.value.first and len(device.calls) == 4  # refused launches never reach the device again

    class DecodeOnly(SmallDevice):
        def __call__(self, launch: KernelLaunch) -> list[mx.array]:
            if launch.name == "paged_attention":
                self.calls.append((launch.name, 128))
                return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes, strict=True)]
            return super().__call__(launch)

    decode_only = DecodeOnly()
    with caplog.at_level(logging.WARNING, logger="metalserve.kernels"):
        out = run(24, 1, 64, LaunchGuard(decode_only))
    assert decode_only.calls[-1] == ("paged_attention", 128) and out.shape == (23, 24, 64)
    assert caplog.records[-1].getMessage().endswith("the decode kernel runs instead")


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[metal::malloc] Attempting to allocate 90000000000 bytes which is greater than the maximum"),
        ValueError("[metal_kernel] Invalid Metal math mode."),
    ],
)
def test_an_error_that_is_not_a_refusal_propagates_and_is_not_remembered(error: Exception) -> None:
    calls = []

    def failing(launch: KernelLaunch) -> list[mx.array]:
        calls.append(launch.name)
        raise error

    guard = LaunchGuard(failing)
    for _ in range(2):  # before: a LaunchRefused, and the kernel off for the rest of the process
        with pytest.raises(type(error), match=str(error)[:20].replace("[", r"\[")):
            run(9, 3, 64, guard)
    assert not guard.refused and calls == ["paged_attention_tiled", "paged_attention_tiled"]


def test_what_counts_as_a_refusal() -> None:
    assert is_launch_refusal(refusal(512, 256))
    assert is_launch_refusal(RuntimeError("Threadgroup memory size (40960) exceeds the maximum (32768)"))
    assert not is_launch_refusal(RuntimeError("[metal::Device] Unable to build metal library from source"))
