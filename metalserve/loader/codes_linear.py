"""Linear and embedding layers whose weights exist only as packed codes (MLX's CPU backend).

A GGUF loaded for the CPU fast path keeps every quantized matrix in its codes
(metalserve/kernels/cpu/packed_codes.py) and no fp32 copy: these modules stand where mlx-lm's
`nn.Linear` / `nn.Embedding` stood, so every route through the model's modules still works, computing
through the numba kernels (steps the host decoder does not take: long prefill chunks, quantized KV
pages). MLX sees only the activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader.gguf_codes import FileRows

if TYPE_CHECKING:
    from metalserve.kernels.cpu.packed_linear import Segments


@dataclass
class CodeParts:
    """Row blocks of one weight, top to bottom, and the bias; a plain object, so MLX does not take it (or
    the kernel's segments it caches) for parameters."""

    parts: tuple[PackedCodes, ...]
    bias: np.ndarray | None = None
    _segments: Segments | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].columns)

    def segments(self) -> Segments:
        if self._segments is None:
            from metalserve.kernels.cpu.packed_linear import segments_of

            self._segments = segments_of([list(self.parts)], None if self.bias is None else self.bias[None])
        return self._segments


def _to_mx(values: np.ndarray, like: mx.array) -> mx.array:
    out = mx.array(values)
    return out if like.dtype == mx.float32 else out.astype(like.dtype)


class CodesLinear(nn.Module):
    """`x @ w.T (+ bias)` with `w` the concatenation of packed row blocks."""

    def __init__(self, parts: list[PackedCodes], bias: mx.array | None = None) -> None:
        super().__init__()
        if bias is not None:
            self.bias = bias.astype(mx.float32)
            mx.eval(self.bias)
        self.code_parts = CodeParts(tuple(parts), None if bias is None else np.asarray(self.bias))

    @property
    def parts(self) -> tuple[PackedCodes, ...]:
        return self.code_parts.parts

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.code_parts.shape

    def host(self, x: np.ndarray) -> np.ndarray:
        """`[T, in]` float32 -> `[T, out]` float32."""
        from metalserve.kernels.cpu.packed_linear import packed_linear

        return packed_linear(x, self.code_parts.segments())

    def __call__(self, x: mx.array) -> mx.array:
        # The output width is named: a step that samples no row (a prefill chunk mid-prompt) asks the head
        # for zero rows, and an empty array's -1 cannot be inferred.
        out_dims = self.weight_shape[0]
        mx.eval(x)
        flat = np.asarray(x.astype(mx.float32)).reshape(-1, x.shape[-1])
        if flat.shape[0] == 0:
            return mx.zeros((*x.shape[:-1], out_dims), dtype=x.dtype)
        return _to_mx(self.host(flat), x).reshape(*x.shape[:-1], out_dims)

    @staticmethod
    def fuse(layers: list[CodesLinear]) -> CodesLinear | None:
        """One layer whose output is the concatenation of `layers`' outputs (their blocks, not copied)."""
        if len({("bias" in layer) for layer in layers}) != 1 or len({la.weight_shape[1] for la in layers}) != 1:
            return None
        bias = mx.concatenate([layer.bias for layer in layers]) if "bias" in layers[0] else None
        return CodesLinear([p for layer in layers for p in layer.parts], bias)


class CodesEmbedding(nn.Module):
    """An embedding table kept in its codes: lookups unpack rows; `as_linear` (a tied head) reads them. Or
    an untied table left in its GGUF's bytes (FileRows), whose lookups convert the rows they read."""

    def __init__(self, codes: PackedCodes | FileRows) -> None:
        super().__init__()
        self.table = codes  # a plain object: MLX takes only arrays, lists and dicts for parameters
        self.code_parts = CodeParts((codes,) if isinstance(codes, PackedCodes) else ())
        self._head: CodesLinear | None = None

    @property
    def codes(self) -> PackedCodes:
        """The table's codes (a table left in its file has none held: its head is another matrix)."""
        if not self.code_parts.parts:
            raise TypeError("this embedding is read from its file; it has no codes to share with a head")
        return self.code_parts.parts[0]

    @property
    def weight(self) -> mx.array:
        """A lazy stand-in with the table's shape and dtype, for code that reads only those; never evaluated."""
        return mx.zeros(self.table.shape, mx.float32)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The fp32 rows `ids` (flat int64) `[len(ids), hidden]`."""
        table = self.table
        if isinstance(table, PackedCodes):
            from metalserve.kernels.cpu.packed_linear import gather_rows

            return gather_rows(table, ids)
        return table.rows(ids)

    def __call__(self, ids: mx.array) -> mx.array:
        mx.eval(ids)
        rows = self.lookup(np.asarray(ids).reshape(-1))
        return mx.array(rows).reshape(*ids.shape, self.table.shape[1])

    def as_linear(self, x: mx.array) -> mx.array:
        if self._head is None:
            self._head = CodesLinear([self.codes])
        return self._head(x)


def swap_in_codes(model: nn.Module, codes: dict[str, PackedCodes | FileRows]) -> dict[str, PackedCodes | FileRows]:
    """Put a CodesLinear / CodesEmbedding where each path in `codes` names an `nn.Linear` / `nn.Embedding`
    (whose weight, not yet evaluated, is dropped); any other module gets its dense weight from the codes.
    Returns the codes the model holds (paths the model dropped, e.g. a tied head or a pipeline stage's
    other layers, left out)."""
    modules = dict(model.named_modules())
    swapped: list[tuple[str, nn.Module]] = []
    held = {}
    for path, packed in codes.items():
        module = modules.get(path)
        if module is None:
            continue
        held[path] = packed
        if type(module) is nn.Embedding:
            swapped.append((path, CodesEmbedding(packed)))
        elif not isinstance(packed, PackedCodes):  # a table left in its file is only ever an embedding
            raise TypeError(f"{path} is a {type(module).__name__}, not the embedding its file rows stand for")
        elif type(module) is nn.Linear:
            swapped.append((path, CodesLinear([packed], module.get("bias"))))
        else:
            module.weight = mx.array(packed.dense())
            del held[path]
    if swapped:
        model.update_modules(_nested(swapped))
    return held


def _nested(pairs: list[tuple[str, nn.Module]]) -> dict:
    """`a.b.0.c` paths -> the nested dicts and lists `update_modules` takes."""
    from mlx.utils import tree_unflatten

    return tree_unflatten(pairs)
