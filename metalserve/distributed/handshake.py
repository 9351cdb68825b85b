"""Start-up agreement: every rank reports (load status, model fingerprint, KV capacity, its slice) and
every rank checks the others, so a rank that cannot load or holds another model stops all of them
with one clear message instead of a hang."""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

MESSAGE_CHARS = 400
_FIXED = 16  # ok, 8 fingerprint words, fits, start, stop, weight MiB, kv bytes/block (lo, hi), block size


class StartupError(RuntimeError):
    """A rank failed to start, or the ranks disagree; the message says which and why."""


class RankReport(NamedTuple):
    ok: bool
    fingerprint: tuple[int, ...]
    blocks_fit: int  # KV blocks this rank's memory can hold for its layers
    layers: range
    weight_mib: int
    kv_bytes_per_block: int
    message: str  # why it failed, or ""
    block_size: int = 0  # --block-size: block ids mean the same on every rank only if it is the same

    def encode(self) -> mx.array:
        kv = self.kv_bytes_per_block
        fixed = [
            int(self.ok),
            *self.fingerprint,
            self.blocks_fit,
            self.layers.start,
            self.layers.stop,
            self.weight_mib,
            kv & 0x7FFFFFFF,
            kv >> 31,
            self.block_size,
        ]
        text = self.message.encode()[:MESSAGE_CHARS].ljust(MESSAGE_CHARS, b"\0")
        return mx.array(fixed + list(text), dtype=mx.int32)

    @classmethod
    def decode(cls, row: list[int]) -> RankReport:
        fp = tuple(row[1:9])
        text = bytes(row[_FIXED:]).rstrip(b"\0").decode(errors="replace")
        kv = row[13] | (row[14] << 31)
        return cls(bool(row[0]), fp, row[9], range(row[10], row[11]), row[12], kv, text, row[15])

    @classmethod
    def failed(cls, message: str) -> RankReport:
        return cls(False, (0,) * 8, 0, range(0, 0), 0, 0, message)


# Tensors every rank reads to tell checkpoints apart: the norms and the first layer's query projection
# (one matrix: reading a lazy weight loads all of it, so not the embedding).
_SAMPLED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight",
)


def fingerprint(model: nn.Module, config: dict[str, object]) -> tuple[int, ...]:
    """Eight int32 words naming the model: its config, every parameter's name, shape and dtype, and the
    values of a few tensors (a different checkpoint of the same shapes differs there)."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    leaves: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    for name in sorted(leaves):
        a = leaves[name]
        h.update(f"{name}{a.shape}{a.dtype}".encode())
        if name.endswith(_SAMPLED):
            h.update(np.array(a.astype(mx.float32)).tobytes())  # exact for every float dtype
    return tuple(int(w) for w in np.frombuffer(h.digest(), dtype=np.int32))


def exchange(report: RankReport, group: mx.distributed.Group) -> list[RankReport]:
    """Every rank's report, on every rank (one all_gather)."""
    rows = mx.distributed.all_gather(report.encode()[None], group=group)
    mx.eval(rows)
    table: list[list[int]] = np.array(rows).tolist()
    return [RankReport.decode(r) for r in table]


def check_reports(reports: list[RankReport], role: str = "pipeline", tp: int = 1) -> None:
    """Raise StartupError naming the first rank that failed or holds a different model than rank 0.
    `role` names the ranks in the message ("pipeline", "tensor-parallel"); `tp`: a pipeline's stages
    each of `tp` consecutive ranks holding the same layers."""
    for rank, r in enumerate(reports):
        if not r.ok:
            raise StartupError(f"{role} rank {rank} could not start: {r.message}")
    for rank, r in enumerate(reports[1:], start=1):
        if r.fingerprint != reports[0].fingerprint:
            raise StartupError(
                f"{role} rank {rank} loaded a different model than rank 0 (config or weights differ): "
                "give every host the same model files"
            )
    for rank, r in enumerate(reports[1:], start=1):
        if r.block_size != reports[0].block_size:
            raise StartupError(
                f"{role} rank {rank} runs --block-size {r.block_size}, rank 0 {reports[0].block_size}: "
                "give every rank the same flags"
            )
    for rank in range(1, len(reports)):
        prev, here = reports[rank - 1].layers, reports[rank].layers
        if rank % tp and here != prev:
            raise StartupError(f"{role} ranks {rank - 1} and {rank} (one stage) disagree on the layer split")
        if not rank % tp and here.start != prev.stop:
            raise StartupError(f"{role} ranks {rank - 1} and {rank} disagree on the layer split")
