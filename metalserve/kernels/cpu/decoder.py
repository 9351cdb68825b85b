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
from numba import types
from numba.extending import overload

from metalserve.kernels.cpu import attention as cpu_attention
from metalserve.kernels.cpu import attention_prefill as cpu_attention_prefill
from metalserve.kernels.cpu import fast_exp as cpu_fast_exp
from metalserve.kernels.cpu import gemm as cpu_gemm
from metalserve.kernels.cpu import int8_dot as cpu_int8_dot
from metalserve.kernels.cpu import int8_segments as cpu_int8_segments
from metalserve.kernels.cpu import int8_windows as cpu_int8_windows
from metalserve.kernels.cpu import layer_ops as cpu_layer_ops
from metalserve.kernels.cpu import lora as cpu_lora
from metalserve.kernels.cpu import packed_gemm as cpu_packed_gemm
from metalserve.kernels.cpu import packed_linear as cpu_packed_linear
from metalserve.kernels.cpu import packed_unpack as cpu_packed_unpack
from metalserve.kernels.cpu import page_codes as cpu_page_codes
from metalserve.kernels.cpu import quantized_attention as cpu_quantized_attention
from metalserve.kernels.cpu import swiglu as cpu_swiglu
from metalserve.kernels.cpu.arg_types import register_memoized_type
from metalserve.kernels.cpu.attention import attend
from metalserve.kernels.cpu.decoder_weights import DecoderWeights
from metalserve.kernels.cpu.gemm import host_gemm
from metalserve.kernels.cpu.layer_ops import _rms_norm_kernel, _rope_kernel
from metalserve.kernels.cpu.lora import lora_add
from metalserve.kernels.cpu.numba_lock import launch_lock
from metalserve.kernels.cpu.packed_gemm import GEMM_MIN_ROWS, segments_gemm_kernel
from metalserve.kernels.cpu.packed_linear import segments_linear_kernel
from metalserve.kernels.cpu.page_codes import attend_pages, hadamard_rows, store_vector
from metalserve.kernels.cpu.swiglu import _gelu_tanh_glu_kernel, _swiglu_kernel

if TYPE_CHECKING:
    from metalserve.kernels.cpu.decoder_weights import (
        DecoderLora,
        DecoderShape,
        HostLoraStep,
        QuantPages,
    )
    from metalserve.kernels.cpu.paged import CpuStepPlan

register_memoized_type(DecoderWeights)  # numba's typeof would rebuild its nested type every step


def kernel_sources_digest() -> str:
    """A hash of the files whose kernels the decoder calls.

    numba keys a cached function on its own bytecode and closure, not on the jitted functions it calls
    from other files: after an edit there, a cached decoder would still run the old kernel. Each function
    below closes over this digest, so such an edit is a cache miss instead.
    """
    digest = hashlib.sha256()
    modules = [cpu_attention, cpu_attention_prefill, cpu_fast_exp, cpu_gemm, cpu_int8_dot, cpu_int8_windows]
    modules += [cpu_int8_segments, cpu_layer_ops, cpu_lora]
    modules += [cpu_packed_gemm, cpu_packed_linear, cpu_packed_unpack, cpu_swiglu, cpu_page_codes]
    for module in (*modules, cpu_quantized_attention):
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


def attend_step(pool, q, k, v, plan, scale, window, softcap, gemm):  # noqa: ANN001, ANN201
    """Write this step's K `[T, Hkv, D]` and V `[T, Hkv * D]` into a layer's pages and attend every row
    of q `[T, Hq, D]` over them: `[T, Hq, D]`. Float pages are the pool `[2, Hkv, slots, D]`; quantized ones
    a `QuantPages` (decoder_weights.py), each numba type its own implementation below."""
    raise NotImplementedError("compiled only (numba overload)")


@overload(attend_step, jit_options={"fastmath": True, "nogil": True})
def _attend_step_typed(pool, q, k, v, plan, scale, window, softcap, gemm):  # noqa: ANN001, ANN202
    if isinstance(pool, types.Array):

        def float_pages(pool, q, k, v, plan, scale, window, softcap, gemm):  # noqa: ANN001, ANN202
            tokens, hkv, d = k.shape
            for t in range(tokens):  # this step's K and V into their slots
                slot = plan.slot_mapping[t]
                for h in range(hkv):
                    for c in range(d):
                        pool[0, h, slot, c] = k[t, h, c]
                        pool[1, h, slot, c] = v[t, h * d + c]
            out = np.empty(q.shape, np.float32)
            no_sinks = np.zeros(q.shape[1], np.float32)
            block_tables, row_req, row_pos = plan.block_tables, plan.row_req, plan.row_pos
            # long runs of one request's rows (a prefill chunk) by GEMMs, the rest row by row
            args = (block_tables, row_req, row_pos, plan.block_size, scale, window, softcap, no_sinks, False, gemm, out)
            attend(q, pool, *args)
            return out

        return float_pages

    def quantized_pages(pool, q, k, v, plan, scale, window, softcap, gemm):  # noqa: ANN001, ANN202
        # Quantized pages hold K and V Hadamard-rotated (executor/attention/rotation.py): q, K and V in,
        # the output back out (H is its own inverse).
        tokens, hq, d = q.shape
        hkv = k.shape[1]
        hadamard_rows(q.reshape(tokens * hq, d))
        hadamard_rows(k.reshape(tokens * hkv, d))
        values = np.ascontiguousarray(v).reshape(tokens * hkv, d)
        hadamard_rows(values)
        kp, vp = pool.k, pool.v
        for t in range(tokens):
            slot = plan.slot_mapping[t]
            for h in range(hkv):
                store_vector(kp.codes[h], kp.scales[h], kp.biases[h], kp.storage, slot, k[t, h])
                store_vector(vp.codes[h], vp.scales[h], vp.biases[h], vp.storage, slot, values[t * hkv + h])
        out = np.empty(q.shape, np.float32)
        attend_pages(
            q, pool, plan.block_tables, plan.row_req, plan.row_pos, plan.block_size, scale, window, softcap, out
        )
        hadamard_rows(out.reshape(tokens * hq, d))
        return out

    return quantized_pages


def _compile_layers(kernels_digest: str) -> tuple[Any, ...]:  # numba dispatchers
    """One layer's attention block, and every layer of the decoder."""
    jit = _jit()

    @jit
    def attention(x, w, shape, layer, pools, plans, chunks, lora, step, gemm):  # noqa: ANN001, ANN202
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
        plan = plans[layer]
        inv_freq, rope_scale, mscale = w.rope_inv_freq[layer], w.rope_scales[layer], w.rope_mscales[layer]
        _rope_kernel(q, plan.row_pos, inv_freq, rope_scale, mscale)
        _rope_kernel(k, plan.row_pos, inv_freq, rope_scale, mscale)
        scale, softcap = np.float32(shape.attention_scale), np.float32(shape.softcap)
        out = attend_step(pools[layer], q, k, v, plan, scale, w.sliding_windows[layer], softcap, gemm)
        flat = out.reshape(tokens, hq * d)
        o = _linear(flat, w.o, layer, chunks, gemm)
        lora_add(flat, o, lora.o, layer, step)
        return o

    @jit
    def decoder(h, w, shape, pools, plans, chunks, lora, step, gemm):  # noqa: ANN001, ANN202
        kernels_digest  # noqa: B018  (a closure cell: part of numba's cache key)
        eps = np.float32(shape.norm_eps)
        x = np.empty_like(h)
        for layer in range(w.input_norm.shape[0]):
            _rms_norm_kernel(h, w.input_norm[layer], eps, x)
            out = _attention(x, w, shape, layer, pools, plans, chunks, lora, step, gemm)
            if shape.sandwich_norms:  # in place: each row's sum is taken before its first write
                _rms_norm_kernel(out, w.attn_out_norm[layer], eps, out)
            h += out
            _rms_norm_kernel(h, w.post_attention_norm[layer], eps, x)
            gate_up = _linear(x, w.gate_up, layer, chunks, gemm)
            lora_add(x, gate_up, lora.gate_up, layer, step)
            hidden = np.empty((h.shape[0], gate_up.shape[1] // 2), np.float32)
            if shape.gelu:
                _gelu_tanh_glu_kernel(gate_up, hidden)
            else:
                _swiglu_kernel(gate_up, hidden)
            out = _linear(hidden, w.down, layer, chunks, gemm)
            lora_add(hidden, out, lora.down, layer, step)
            if shape.sandwich_norms:
                _rms_norm_kernel(out, w.mlp_out_norm[layer], eps, out)
            h += out
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
    pools: tuple[np.ndarray, ...] | tuple[QuantPages, ...],
    plans: tuple[CpuStepPlan, ...],
    lora: DecoderLora,
    step: HostLoraStep,
) -> np.ndarray:
    """Run every layer over `h` `[T, hidden]` float32 (updated in place and returned), writing each
    layer's K/V into `pools[layer]` (the float pool `[2, Hkv, num_slots, D]` or a layer's `QuantPages`)
    and attending over them with `plans[layer]` (its group's tables: gemma3's sliding and full layers
    keep their own); the adapter tokens of `step` add their slot's LoRA delta (`lora`) after each
    projection."""
    layers = weights.input_norm.shape[0]
    if h.dtype != np.float32 or not h.flags.c_contiguous or len(pools) != layers or len(plans) != layers:
        raise ValueError(f"decoder_layers takes contiguous [T, hidden] float32 and one pool per layer, got {h.shape}")
    with launch_lock:
        chunks = numba.get_num_threads() * 8  # several per thread even out a core that is busy elsewhere
        return _decoder_layers(h, weights, shape, pools, plans, chunks, lora, step, host_gemm())
