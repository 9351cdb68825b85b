"""Logit bias, min_tokens masking and repetition / presence / frequency penalties, applied sparsely.

Each of these touches only the tokens a request names or has seen, so the host lists those (row, token)
pairs and the device gathers and scatters just them, never a dense [B, V] mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metalserve.executor.array_backend import Array, ArrayBackend
from metalserve.sampling_params import SamplingRequest


def _in_vocab(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    # Ids outside the logits (a tokenizer larger than the model's head) have no logit to change.
    return tokens[(tokens >= 0) & (tokens < vocab_size)]


def apply_logit_bias(
    be: ArrayBackend, logits: Array, requests: Sequence[SamplingRequest], rows: Sequence[int]
) -> Array:
    """Add each request's logit_bias to its row; a token id outside the vocabulary is an error."""
    vocab_size = logits.shape[-1]
    r: list[int] = []
    c: list[int] = []
    v: list[float] = []
    for row in rows:
        for token, bias in requests[row].sampling_params.logit_bias.items():
            if not 0 <= int(token) < vocab_size:
                raise ValueError(f"logit_bias token id {token} is outside the vocabulary (size {vocab_size})")
            r.append(row)
            c.append(int(token))
            v.append(float(bias))
    if not r:
        return logits
    return be.scatter(logits, be.asarray(r, "int64"), be.asarray(c, "int64"), be.asarray(v), "add")


def apply_min_tokens(
    be: ArrayBackend, logits: Array, requests: Sequence[SamplingRequest], rows: Sequence[int]
) -> Array:
    """Mask EOS (unless ignore_eos) and stop_token_ids to -inf for rows still below min_tokens."""
    vocab_size = logits.shape[-1]
    r: list[np.ndarray] = []
    c: list[np.ndarray] = []
    for row in rows:
        banned = requests[row].sampling_params.stop_ids(requests[row].eos_token_ids)
        tokens = _in_vocab(np.fromiter(banned, dtype=np.int64, count=len(banned)), vocab_size)
        r.append(np.full(tokens.shape, row, dtype=np.int64))
        c.append(tokens)
    if not r or sum(len(x) for x in c) == 0:
        return logits
    cols = np.concatenate(c)
    minus_inf = be.asarray(np.full(len(cols), -np.inf, dtype=np.float32))
    return be.scatter(logits, be.asarray(np.concatenate(r), "int64"), be.asarray(cols, "int64"), minus_inf, "minimum")


def _penalty_pairs(request: SamplingRequest, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The request's distinct penalised tokens (sorted) and how often each occurs in its output."""
    params = request.sampling_params
    output = _in_vocab(np.asarray(request.output_token_ids, dtype=np.int64), vocab_size)
    if params.repetition_penalty != 1.0:
        prompt = _in_vocab(np.asarray(request.prompt_token_ids, dtype=np.int64), vocab_size)
        tokens = np.unique(np.concatenate([prompt, output]))
    else:
        tokens = np.unique(output)
    counts = np.bincount(np.searchsorted(tokens, output), minlength=len(tokens))
    return tokens, counts.astype(np.float32)


def apply_penalties(be: ArrayBackend, logits: Array, requests: Sequence[SamplingRequest], rows: Sequence[int]) -> Array:
    """vLLM/OpenAI penalties: repetition over prompt + output (divide positive logits, multiply
    negative ones), then presence and frequency over the output only (subtract p + f * count)."""
    vocab_size = logits.shape[-1]
    pairs = [_penalty_pairs(requests[row], vocab_size) for row in rows]
    sizes = np.array([len(tokens) for tokens, _ in pairs], dtype=np.int64)
    if sizes.sum() == 0:
        return logits
    params = [requests[row].sampling_params for row in rows]

    def per_pair(values: list[float]) -> Array:
        return be.asarray(np.repeat(np.asarray(values, dtype=np.float32), sizes))

    ri = be.asarray(np.repeat(np.asarray(rows, dtype=np.int64), sizes), "int64")
    ci = be.asarray(np.concatenate([tokens for tokens, _ in pairs]), "int64")
    count = be.asarray(np.concatenate([c for _, c in pairs]))
    rep = per_pair([p.repetition_penalty for p in params])
    # Multiplying by a factor keeps a -inf (a masked token) at -inf, which adding a delta would not.
    factor = be.xp.where(logits[ri, ci] > 0, 1.0 / rep, rep)
    logits = be.scatter(logits, ri, ci, factor, "multiply")
    freq = per_pair([p.frequency_penalty for p in params])
    pres = per_pair([p.presence_penalty for p in params])
    return be.scatter(logits, ri, ci, -(freq * count + pres * (count > 0)), "add")
