"""Every decoder layer of a llama-family model in one numba call, for the host forward's small steps.

Run layer by layer from Python, a batch-1 step of the default model made some 330 kernel calls, each
paying Python glue, argument typing and an allocation: about a quarter of the step beside 17 ms of
matmuls. Here the same kernels (packed-codes matmul, RMSNorm, RoPE, paged attention, SwiGLU) are called from
compiled code, so a step crosses from Python into numba once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numba
import numpy as np

from metalserve.kernels.cpu import attention as cpu_attention
from metalserve.kernels.cpu import attention_prefill as cpu_attention_prefill
from metalserve.kernels.cpu import gemm as cpu_gemm
from metalserve.kernels.cpu import layer_ops as cpu_layer_ops
from metalserve.kernels.cpu import lora as cpu_lora
from metalserve.kernels.cpu import packed_gemm as cpu_packed_gemm
from metalserve.kernels.cpu import packed_linear as cpu_packed_linear
from metalserve.kernels.cpu import packed_unpack as cpu_packed_unpack
from metalserve.kernels.cpu import swiglu as cpu_swiglu
from metalserve.kernels.cpu.attention import attend
from metalserve.kernels.cpu.gemm import host_gemm
from metalserve.kernels.cpu.layer_ops import _rms_norm_kernel, _rope_kernel
from metalserve.kernels.cpu.lora import lora_add
from metalserve.kernels.cpu.numba_lock import launch_lock
from metalserve.kernels.cpu.packed_gemm import GEMM_MIN_ROWS, segments_gemm_kernel
from metalserve.kernels.cpu.packed_linear import segments_linear_kernel
from metalserve.kernels.cpu.swiglu import _swiglu_kernel

if TYPE_CHECKING:
    from metalserve.kernels.cpu.decoder_weights import DecoderLora, DecoderShape, DecoderWeights, HostLoraStep
    from metalserve.kernels.cpu.paged import CpuStepPlan


def kernel_sources_digest() -> str:
    """A hash of the files whose kernels the decoder calls.

    numba keys a cached function on its own bytecode and closure, not on the jitted functions it calls
    from other files: after an edit there, a cached decoder would still run the old kernel. Each function
    below closes over this digest, so such an edit is a cache miss instead.
    """
    digest = hashlib.sha256()
    modules = (cpu_attention, cpu_attention_prefill, cpu_gemm, cpu_layer_ops, cpu_lora, cpu_packed_gemm)
    for module in (*modules, cpu_packed_linear, cpu_packed_unpack, cpu_swiglu):
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()


def _jit() -> Any:
    return numba.njit(fastmath=True, cache=True, nogil=True)


def _compile_ops(kernels_digest: str) -> tuple[Any, ...]:  # numba dispatchers
    """The projection and the q/k head norm the layers call."""
    jit = _jit()

    @jit
    def linear(x, weight, layer, chunks, gemm):  # noqa: ANN001, ANN202  (numba infers the types)
        kernels_digest  # noqa: B018  (a closure cell: part of numba's cache key)
        out = np.empty((x.shape[0], weight.bias.shape[1]), np.float32)
        if x.shape[0] >= GEMM_MIN_ROWS and gemm.usable:  # a prefill chunk: fp32 tiles and MKL's GEMM
            segments_gemm_kernel(x, weight, layer, gemm, out)
        else:
            segments_linear_kernel(x, weight, layer, chunks, out)  # both add the bias
        return out

    @jit
    def head_norm(x, weight, eps):  # noqa: ANN001, ANN202
        kernels_digest  # noqa: B018  (a closure cell: part of numba's cache key)
        flat = x.reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        _rms_norm_kernel(flat, weight, eps, out)
        return out.reshape(x.shape)

    return linear, head_norm


def _compile_layers(kernels_digest: str) -> tuple[Any, ...]:  # numba dispatchers
    """One layer's attention block, and every layer of the decoder."""
    jit = _jit()

    @jit
    def attention(x, w, shape, layer, pools, plan, chunks, lora, step, gemm):  # noqa: ANN001, ANN202
        kernels_digest  # noqa: B018  (a closure cell: part of numba's cache key)
        tokens = x.shape[0]
        hq, hkv, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
        qkv = _linear(x, w.qkv, layer, chunks, gemm)
        lora_add(x, qkv, lora.qkv, layer, step)
        q = np.ascontiguousarray(qkv[:, : hq * d]).reshape(tokens, hq, d)
        k = np.ascontiguousarray(qkv[:, hq * d : (hq + hkv) * d]).reshape(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :]
        if shape.head_norms:
            q = _head_norm(q, w.q_norm[layer], np.float32(shape.head_norm_eps))
            k = _head_norm(k, w.k_norm[layer], np.float32(shape.head_norm_eps))
        _rope_kernel(q, plan.row_pos, w.rope_inv_freq, np.float32(shape.rope_scale))
        _rope_kernel(k, plan.row_pos, w.rope_inv_freq, np.float32(shape.rope_scale))
        pool = pools[layer]
        for t in range(tokens):  # this step's K and V into their slots
            slot = plan.slot_mapping[t]
            for h in range(hkv):
                for c in range(d):
                    pool[0, h, slot, c] = k[t, h, c]
                    pool[1, h, slot, c] = v[t, h * d + c]
        out = np.empty((tokens, hq, d), np.float32)
        no_sinks = np.zeros(hq, np.float32)
        attend(  # long runs of one request's rows (a prefill chunk) by GEMMs, the rest row by row
            q,
            pool,
            plan.block_tables,
            plan.row_req,
            plan.row_pos,
            plan.block_size,
            np.float32(shape.attention_scale),
            w.sliding_windows[layer],
            np.float32(shape.softcap),
            no_sinks,
            False,
            gemm,
            out,
        )
        flat = out.reshape(tokens, hq * d)
        o = _linear(flat, w.o, layer, chunks, gemm)
        lora_add(flat, o, lora.o, layer, step)
        return o

    @jit
    def decoder(h, w, shape, pools, plan, chunks, lora, step, gemm):  # noqa: ANN001, ANN202
        kernels_digest  # noqa: B018  (a closure cell: part of numba's cache key)
        eps = np.float32(shape.norm_eps)
        x = np.empty_like(h)
        for layer in range(w.input_norm.shape[0]):
            _rms_norm_kernel(h, w.input_norm[layer], eps, x)
            h += _attention(x, w, shape, layer, pools, plan, chunks, lora, step, gemm)
            _rms_norm_kernel(h, w.post_attention_norm[layer], eps, x)
            gate_up = _linear(x, w.gate_up, layer, chunks, gemm)
            lora_add(x, gate_up, lora.gate_up, layer, step)
            hidden = np.empty((h.shape[0], gate_up.shape[1] // 2), np.float32)
            _swiglu_kernel(gate_up, hidden)
            down = _linear(hidden, w.down, layer, chunks, gemm)
            lora_add(hidden, down, lora.down, layer, step)
            h += down
        return h

    return attention, decoder


# Module globals, which the functions above call by name (a closure cell holding a dispatcher would not
# pickle the same way twice, and so would miss the cache every time).
_DIGEST = kernel_sources_digest()
_linear, _head_norm = _compile_ops(_DIGEST)
_attention, _decoder_layers = _compile_layers(_DIGEST)


def decoder_layers(
    h: np.ndarray,
    weights: DecoderWeights,
    shape: DecoderShape,
    pools: tuple[np.ndarray, ...],
    plan: CpuStepPlan,
    lora: DecoderLora,
    step: HostLoraStep,
) -> np.ndarray:
    """Run every layer over `h` `[T, hidden]` float32 (updated in place and returned), writing each
    layer's K/V into `pools[layer]` `[2, Hkv, num_slots, D]` and attending over them; the adapter tokens
    of `step` add their slot's LoRA delta (`lora`) after each projection."""
    if h.dtype != np.float32 or not h.flags.c_contiguous or len(pools) != weights.input_norm.shape[0]:
        raise ValueError(f"decoder_layers takes contiguous [T, hidden] float32 and one pool per layer, got {h.shape}")
    with launch_lock:
        chunks = numba.get_num_threads() * 8  # several per thread even out a core that is busy elsewhere
        return _decoder_layers(h, weights, shape, pools, plan, chunks, lora, step, host_gemm())
