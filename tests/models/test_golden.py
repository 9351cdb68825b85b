"""Every covered architecture, served by the real engine, generates mlx-lm's own greedy tokens.

Default run: each architecture's short prompt alone; the windowed ones (and gpt-oss and gemma2 on MLX
ops, for sinks, windows and the soft-cap there) also the long prompt batched under a small token budget
and again from the prefix cache. The rest of that matrix is `slow`.
"""

from __future__ import annotations

import pytest

from tests.models import golden
from tests.models.archs import ARCHS, VOCAB, build

WINDOWED = ("gemma3_text", "gemma4_text", "gpt_oss", "olmo3", "ministral3", "cohere2", "exaone4")
SINKS_AND_SOFTCAP = ("gpt_oss", "gemma2")


def _slow_unless(default: tuple[str, ...]) -> list[object]:
    return [a if a in default else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_short_prompt_alone(arch: str) -> None:
    (prompt,) = golden.prompts([golden.SHORT], VOCAB)
    want = golden.reference(build(arch), prompt)
    (got,) = golden.serve(golden.engine(build(arch)), [prompt])
    golden.check(got, want)


def _long_batched_then_cached(arch: str, backend: str) -> None:
    short, long = golden.prompts([golden.SHORT, golden.LONG], VOCAB, seed=2)
    model = build(arch)
    want_short, want_long = golden.reference(model, short), golden.reference(model, long)
    core = golden.engine(build(arch), budget=64, backend=backend)  # chunked: 300 tokens in 5 steps
    got_short, got_long = golden.serve(core, [short, long])
    golden.check(got_short, want_short)
    golden.check(got_long, want_long)
    (again,) = golden.serve(core, [long], tag="again")
    assert again.cached_tokens >= golden.LONG - 16  # every full block but the last came from the cache
    golden.check(again, want_long)


@pytest.mark.parametrize("arch", _slow_unless(WINDOWED))
def test_long_prompt_batched_chunked_and_from_the_prefix_cache(arch: str) -> None:
    _long_batched_then_cached(arch, "auto")  # the CPU backend (numba) on this float32 model


@pytest.mark.parametrize("arch", _slow_unless(SINKS_AND_SOFTCAP))
def test_long_prompt_on_mlx_ops(arch: str) -> None:
    _long_batched_then_cached(arch, "mlx")


@pytest.mark.parametrize("arch", _slow_unless(("gpt_oss",)))
def test_long_prompt_through_the_kernel_backend(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Metal backend's pools and per-group metadata, with the contract's MLX function as its kernel
    (the Metal kernel itself needs a Mac; its emulator rows are in tests/kernels)."""
    from metalserve.executor.attention import mlx_ops
    from metalserve.executor.attention.metal import KernelAttention
    from metalserve.serving import build as core

    backend = KernelAttention(mlx_ops.paged_attention, "contract", "the kernel contract in MLX ops")
    monkeypatch.setattr(core, "select_attention", lambda *args, **kwargs: backend)
    _long_batched_then_cached(arch, "auto")
