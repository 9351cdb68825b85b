"""The host-compute strategy: on MLX's CPU backend, small steps run on the host from stored codes.

What it installs: the MLP's gated activation through numba (`HostGatedMLP`), every projection whose codes the
loader kept as a `HostLinear`, the vocabulary projection through NumPy (from its codes in small steps)
and, where every block has a host twin, the whole decoder in one numba call (`HostForward`). A step
that the host forward takes stays in NumPy from the token ids to the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.context import current_context
from metalserve.executor.host.forward import HostForward
from metalserve.executor.host.linear import HOST_LINEAR_MAX_TOKENS, HostLinear, host_codes
from metalserve.executor.host.mlp import HostGatedMLP, is_gated_mlp
from metalserve.executor.models.adapter import PagedModel
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader.codes_linear import CodeParts, CodesEmbedding, CodesLinear

# The projections a layer's codes feed: (outer module's attribute, inner module's attribute), each with
# the loader's module paths whose codes it fuses, in order.
Projections = tuple[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]]
_ATTENTION: Projections = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",)))
_MLP: Projections = (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))


class HostCompute:
    def __init__(self, codes: Mapping[str, PackedCodes]) -> None:
        self.codes = codes
        self.linears = 0  # projections that read their codes
        self.head: np.ndarray | None = None  # a NumPy view of a dense float32 vocabulary projection
        self.head_codes: CodeParts | None = None
        self.forward_on_host: HostForward | None = None
        self._root: nn.Module | None = None  # the mlx-lm model installed on

    def _parts(self, prefix: str, attr: str, names: tuple[str, ...]) -> list[PackedCodes | None]:
        """The codes of a (fused) projection's row blocks, by the loader's module paths; a projection the
        model ships fused (phi3's qkv_proj, gate_up_proj) under its own path."""
        if f"{prefix}.{attr}" in self.codes:
            return [self.codes[f"{prefix}.{attr}"]]
        return [self.codes.get(f"{prefix}.{name}") for name in names]

    def install(self, model: PagedModel) -> None:
        self._root = model.model
        for layer in model.backbone.layers:
            gate = getattr(layer.mlp, "gate_proj", getattr(layer.mlp, "gate_up_proj", None))
            if is_gated_mlp(layer.mlp) and type(gate) in (nn.Linear, CodesLinear):
                layer.mlp = HostGatedMLP(layer.mlp)
        for i, layer in enumerate(model.backbone.layers):
            owners: list[tuple[nn.Module, nn.Module, str, Projections]] = [
                (layer.self_attn, layer.self_attn.inner, f"model.layers.{i}.self_attn", _ATTENTION)
            ]
            if isinstance(layer.mlp, HostGatedMLP):
                owners.append((layer.mlp, layer.mlp.inner, f"model.layers.{i}.mlp", _MLP))
            for outer, inner, prefix, names in owners:
                for (attr, parts), owner in zip(names, (outer, inner), strict=True):
                    linear = getattr(owner, attr, None)
                    codes = host_codes(linear, self._parts(prefix, attr, parts))
                    if isinstance(linear, (nn.Linear, CodesLinear)) and codes is not None:
                        setattr(owner, attr, HostLinear(linear, codes))
                        self.linears += 1
        mx.eval(model.model.parameters())  # the fused projections, before the host views below
        head = model.backbone.embed_tokens if model.tied else model.model.lm_head
        self.head = _dense_head(head)
        if isinstance(head, (CodesEmbedding, CodesLinear)):
            self.head_codes = CodeParts(head.code_parts.parts, head.code_parts.bias)
        elif self.head is not None:
            stored = self.codes.get("model.embed_tokens" if model.tied else "lm_head")
            if stored is not None and stored.shape == self.head.shape:
                self.head_codes = CodeParts((stored,))
        # The whole decoder on the host for small steps, where every block has a host twin.
        self.forward_on_host = HostForward.build(model.backbone) if self.linears else None

    def host_job(
        self, model: PagedModel, token_ids: np.ndarray, logits_indices: np.ndarray
    ) -> Callable[[], np.ndarray] | None:
        """Attention on the CPU backend and a small step: NumPy (and numba, GIL released) from the ids
        to the logits, as one call that reads the step's context given now."""
        host = self.forward_on_host
        no_head = self.head is None and self.head_codes is None
        if host is None or no_head or (token_ids.size > HOST_LINEAR_MAX_TOKENS and not host.codes_only):
            return None
        ctx = current_context()
        if not host.applies_to(ctx):
            return None
        return lambda: self.head_logits(host(token_ids, ctx)[logits_indices])

    def forward(self, model: PagedModel, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        job = self.host_job(model, token_ids, logits_indices)
        if job is not None:
            return mx.array(job())
        hidden = model.mlx_hidden_states(mx.array(token_ids))[mx.array(logits_indices)]
        if self.head is None and self.head_codes is None:
            return model.mlx_logits(hidden)
        return mx.array(self.head_logits(np.asarray(hidden.astype(mx.float32))))

    def head_logits(self, rows: np.ndarray) -> np.ndarray:
        """`[S, hidden]` float32 rows -> their logits, through NumPy (from the head's codes in small steps)."""
        if self.head_codes is not None and (rows.shape[0] <= HOST_LINEAR_MAX_TOKENS or self.head is None):
            from metalserve.kernels.cpu.packed_linear import packed_linear

            return packed_linear(rows, self.head_codes.segments())
        assert self.head is not None
        return rows @ self.head.T

    def host_bytes(self) -> int:
        modules = self._root.named_modules() if self._root is not None else []
        parts = {
            id(p): p
            for _, m in modules
            if isinstance(m, (HostLinear, CodesLinear, CodesEmbedding))
            for p in m.code_parts.parts
        }
        parts.update({id(p): p for p in (self.head_codes.parts if self.head_codes is not None else ())})
        return sum(p.nbytes for p in parts.values())

    def description(self) -> str:
        layers = self._root.model.layers if self._root is not None else []
        mlps = [layer.mlp for layer in layers if isinstance(layer.mlp, HostGatedMLP)]
        names = sorted({"SwiGLU" if mlp.activation == "silu" else "GeGLU" for mlp in mlps})
        parts = [f"{'/'.join(names)} through numba in {len(mlps)} layers"] if mlps else []
        if self.forward_on_host is not None:
            parts.append(f"the whole decoder through numba in steps of up to {HOST_LINEAR_MAX_TOKENS} tokens")
        if self.linears:
            parts.append(
                f"{self.linears} projections from their stored codes through numba in steps of up to "
                f"{HOST_LINEAR_MAX_TOKENS} tokens"
            )
        if self.head is not None or self.head_codes is not None:
            via = " (from its codes in small steps)" if self.head_codes is not None else ""
            via = " from its codes" if self.head is None else via
            parts.append(f"logits through NumPy{via}")
        return ", ".join(parts) or "nothing (all in MLX)"


def _dense_head(head: nn.Module) -> np.ndarray | None:
    """A NumPy view `[vocab, hidden]` of a dense float32 output projection.

    On MLX's CPU backend NumPy's bundled OpenBLAS, even on the one thread metalserve gives it
    (metalserve/blas.py), ran this one wide matmul (49152 outputs) 1.15x faster than MLX's through MKL at
    batch 1 to 32 (bench/lm_head.py); every other matmul stays MLX's.
    """
    dense = type(head) in (nn.Embedding, nn.Linear) and "bias" not in head and head.weight.dtype == mx.float32
    return np.asarray(head.weight) if dense else None
