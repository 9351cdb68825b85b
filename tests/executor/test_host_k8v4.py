"""k8v4 KV pages (int8 keys, q4 values) on the one-call host decoder: the real engine on the CPU path
(`--attention-backend auto`) against MLX ops over the same page formats, every step through the decoder."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.engine.core import EngineCore
from metalserve.executor.attention.base import LayerCacheSpec
from metalserve.executor.attention.cpu import CpuAttention, HostQuantKV
from metalserve.executor.attention.kv_quant import SplitPool
from metalserve.executor.host.forward import HostForward
from metalserve.kernels.cpu.decoder_weights import PAGE_STORAGES
from metalserve.loader.weights_mode import dequantize_model
from tests.loader.tiny_models import quantize_half_scales
from tests.models.archs import build
from tests.models.golden import engine, loaded_of, prompts, serve


@pytest.mark.parametrize("storage", ["k8v4"])
def test_k8v4_pages_decode_on_the_host_decoder_like_mlx_ops(storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = HostForward.__call__

    def counted(self: HostForward, ids: np.ndarray, ctx: object) -> np.ndarray:
        calls.append(len(ids))
        return real(self, ids, ctx)  # type: ignore[arg-type]

    monkeypatch.setattr(HostForward, "__call__", counted)
    batch = prompts([11, 40, 3], 256, seed=6)

    def core(backend: str) -> EngineCore:
        """A fresh copy of the same model (build is seeded): an engine installs its paged attention in it."""
        model = build("qwen3", head_dim=32)  # q4 values take groups of 32 channels
        quantize_half_scales(model)
        codes = dequantize_model(model, keep_codes=True)
        mx.eval(model.parameters())
        loaded = loaded_of(model, "qwen3")
        loaded.codes = codes
        return engine(model, "qwen3", backend=backend, loaded=loaded, kv_cache_dtype=storage)

    host = core("auto")
    calls.clear()  # the start-up's warm-up step
    assert host.runner.backend.name == "cpu"
    cache = host.runner.kv[0]
    assert isinstance(cache.pool, SplitPool)
    assert (cache.pages.k.storage, cache.pages.v.storage) == (PAGE_STORAGES["int8"], PAGE_STORAGES["q4"])
    got = serve(host, batch)
    assert sum(calls) == 54 + 3 * 11  # every prompt token and every fed-back token
    calls.clear()
    ops = core("mlx")
    assert ops.runner.backend.name == "mlx" and isinstance(ops.runner.kv[0].pool, SplitPool)
    want = serve(ops, batch)
    assert not calls
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-2, rtol=0)  # a code may round the other way
    assert max(abs(lp) for w in want for lp in w.logprobs) > 0.05


def test_k8v4_pages_grow_and_shrink_on_the_cpu_backend_keeping_each_planes_format() -> None:
    """A grown / truncated k8v4 pool keeps its K (int8) and V (q4) planes, and the decoder's pages view
    the new buffers (the views are rebuilt, not left on the old arrays)."""
    backend = CpuAttention()
    spec = LayerCacheSpec.dense(2, 32, mx.float32, 8, 4, storage="k8v4")  # type: ignore[arg-type]
    cache = backend.allocate(spec)
    assert isinstance(cache, HostQuantKV) and isinstance(cache.pool, SplitPool) and cache.planes is not None
    cache.planes[0][0][0, 0, 3] = 7  # an int8 key code, through the host view
    grown = backend.extend(cache, LayerCacheSpec.dense(2, 32, mx.float32, 8, 2, storage="k8v4"))  # type: ignore[arg-type]
    assert isinstance(grown, HostQuantKV) and isinstance(grown.pool, SplitPool)
    assert grown.pages.k.codes.shape == (2, 48, 32) and grown.pages.v.codes.shape == (2, 48, 16)
    assert (grown.pages.k.storage, grown.pages.v.storage) == (PAGE_STORAGES["int8"], PAGE_STORAGES["q4"])
    assert grown.pages.k.codes[0, 3, 0] == 7 and np.shares_memory(grown.pages.k.codes, grown.planes[0][0])
    cut = backend.truncate(grown, spec)
    assert isinstance(cut, HostQuantKV) and cut.pages.v.codes.shape == (2, 32, 16) and cut.pages.k.codes[0, 3, 0] == 7
