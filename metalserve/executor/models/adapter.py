"""Thin adapters over mlx-lm models: swap in paged attention, and compute logits for chosen rows only."""

from __future__ import annotations

import importlib.util

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.context import current_context
from metalserve.executor.models.host_forward import HostForward
from metalserve.executor.models.host_linear import HOST_LINEAR_MAX_TOKENS, HostLinear, host_codes
from metalserve.executor.models.host_mlp import HostSwiGLUMLP, is_swiglu_mlp
from metalserve.executor.models.paged_attention import PagedAttention
from metalserve.loader.affine_codes import AffineCodes

# Families whose attention we know how to take over (mistral loads as llama in mlx-lm).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class PagedModel:
    """An mlx-lm causal LM whose attention layers read and write the paged KV pools."""

    def __init__(self, model: nn.Module, model_type: str, host_compute: bool | None = None) -> None:
        """`host_compute`: on MLX's CPU backend, run the vocabulary projection with NumPy and the MLP's
        activation with numba (see `_host_head`, `HostSwiGLUMLP`); None: exactly there, if numba is installed."""
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        self.model = model
        self.backbone = model.model
        self.host_linears = 0
        self.host_forward: HostForward | None = None
        args = model.args
        window = getattr(args, "sliding_window", None)
        for i, layer in enumerate(self.backbone.layers):
            if isinstance(layer.self_attn, PagedAttention):
                raise ValueError("this model already has paged attention installed")
            uses_window = getattr(layer, "use_sliding", False)
            layer.self_attn = PagedAttention(layer.self_attn, i, window if uses_window else None)
        if host_compute is None:
            host_compute = mx.default_device() == mx.cpu and importlib.util.find_spec("numba") is not None
        if host_compute:
            for layer in self.backbone.layers:
                if is_swiglu_mlp(layer.mlp) and type(layer.mlp.gate_proj) is nn.Linear:
                    layer.mlp = HostSwiGLUMLP(layer.mlp)
            self.host_linears = self._install_host_linears()
        # Materialise the fused projections now, on this thread's stream, before any forward runs.
        mx.eval(model.parameters())
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")
        self.host_head = self._host_head() if host_compute else None
        # The whole decoder on the host for small steps, where every block has a host twin.
        self.host_forward = HostForward.build(self.backbone) if host_compute and self.host_linears else None
        head = self.backbone.embed_tokens if self.tied else getattr(model, "lm_head", None)
        codes = getattr(head, "affine_codes", None) if host_compute and self.host_head is not None else None
        self.host_head_codes: AffineCodes | None = codes if isinstance(codes, AffineCodes) else None

    def _install_host_linears(self) -> int:
        """Wrap every projection that kept its codes in a `HostLinear`; return how many were wrapped."""
        count = 0
        for layer in self.backbone.layers:
            owners = [(layer.self_attn, "qkv_proj"), (layer.self_attn.inner, "o_proj")]
            if isinstance(layer.mlp, HostSwiGLUMLP):
                owners += [(layer.mlp, "gate_up_proj"), (layer.mlp.inner, "down_proj")]
            for owner, name in owners:
                linear = getattr(owner, name, None)
                if not isinstance(linear, nn.Linear) or (codes := host_codes(linear)) is None:
                    continue
                setattr(owner, name, HostLinear(linear, codes))
                count += 1
        return count

    def _host_head(self) -> np.ndarray | None:
        """A NumPy view `[vocab, hidden]` of a dense float32 output projection, for MLX's CPU backend.

        There, NumPy's bundled OpenBLAS, even on the one thread metalserve gives it (loader/blas.py), ran this
        one wide matmul (49152 outputs) 1.15x faster than MLX's through MKL at batch 1 to 32
        (bench/lm_head.py); every other matmul stays MLX's.
        """
        head = self.backbone.embed_tokens if self.tied else self.model.lm_head
        dense = type(head) in (nn.Embedding, nn.Linear) and "bias" not in head and head.weight.dtype == mx.float32
        return np.asarray(head.weight) if dense else None

    def host_bytes(self) -> int:
        """Bytes of weights held outside MLX (the stored codes), which MLX's memory counters do not see."""
        codes = [m.codes for _, m in self.model.named_modules() if isinstance(m, HostLinear)]
        codes += [self.host_head_codes] if self.host_head_codes is not None else []
        return sum(c.codes.nbytes + c.scales.nbytes + c.biases.nbytes for c in codes)

    def host_description(self) -> str:
        """What runs on the host instead of MLX, for the start-up log."""
        host_mlps = sum(isinstance(layer.mlp, HostSwiGLUMLP) for layer in self.backbone.layers)
        parts = [f"SwiGLU through numba in {host_mlps} layers"] if host_mlps else []
        if self.host_forward is not None:
            parts.append(f"the whole decoder through numba in steps of up to {HOST_LINEAR_MAX_TOKENS} tokens")
        if self.host_linears:
            parts.append(
                f"{self.host_linears} projections from their stored codes through numba in steps of up to "
                f"{HOST_LINEAR_MAX_TOKENS} tokens"
            )
        if self.host_head is not None:
            via = " (from its codes in small steps)" if self.host_head_codes is not None else ""
            parts.append(f"logits through NumPy{via}")
        return ", ".join(parts) or "nothing (all in MLX)"

    def hidden_states(self, token_ids: mx.array) -> mx.array:
        """token_ids: [T] -> final-normed hidden states [T, hidden]."""
        if self.host_forward is not None and token_ids.size <= HOST_LINEAR_MAX_TOKENS:
            ctx = current_context()
            if self.host_forward.applies_to(ctx):
                return mx.array(self.host_forward(np.asarray(token_ids), ctx))
        return self.backbone(token_ids[None])[0]

    def logits(self, hidden: mx.array) -> mx.array:
        if self.host_head is not None:
            rows = np.asarray(hidden.astype(mx.float32))
            if self.host_head_codes is not None and rows.shape[0] <= HOST_LINEAR_MAX_TOKENS:
                from metalserve.kernels.cpu_affine_linear import affine_linear

                return mx.array(affine_linear(rows, self.host_head_codes))
            return mx.array(rows @ self.host_head.T)
        if self.tied:
            return self.backbone.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def __call__(self, token_ids: mx.array, logits_indices: mx.array) -> mx.array:
        """Forward the packed tokens; project only the rows that sample to the vocabulary."""
        hidden = self.hidden_states(token_ids)
        return self.logits(hidden[logits_indices])
