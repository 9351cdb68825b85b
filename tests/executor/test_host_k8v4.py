"""k8v4 KV pages (int8 keys, q4 values) on the one-call host decoder: the real engine on the CPU path
(`--attention-backend auto`) against MLX ops over the same page formats, every step through the decoder."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.engine.core import EngineCore
from metalserve.executor.attention.kv_quant import SplitPool
from metalserve.executor.host.forward import HostForward
from metalserve.kernels.cpu.decoder_weights import PAGE_STORAGES
from metalserve.loader.weights_mode import dequantize_model
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
        nn.quantize(model, group_size=32, bits=4)
        codes = dequantize_model(model, keep_codes=True)
        mx.eval(model.parameters())
        loaded = loaded_of(model, "qwen3")
        loaded.codes = codes
        return engine(model, "qwen3", backend=backend, loaded=loaded, kv_cache_dtype=storage)

    host = core("auto")
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
