"""Multimodal RoPE positions (Qwen2-VL, Qwen2.5-VL): three position ids per token (time, height, width).

A text token has the same position in all three; an image's placeholder tokens are laid out on its
merged patch grid, starting where the next text position would be, and the text after the image goes
on from one past the grid's largest position. So a prompt's positions run shorter than its length:
a token after the prompt (an output) at index i has position i + delta, delta = (max + 1) - length.
This is HF's `get_rope_index` for images, per request and in NumPy (the runner packs the rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metalserve.multimodal.inputs import MultiModalInput


def mrope_positions(num_tokens: int, images: Sequence[MultiModalInput], merge_size: int) -> tuple[np.ndarray, int]:
    """The prompt's positions `[3, num_tokens]` and the delta its later tokens add to their index.

    Each image's `data["grid_thw"]` is its patch grid (t, h, w) before the `merge_size` x `merge_size`
    merge; its placeholder covers `t * h * w / merge_size**2` tokens from `offset`."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor = 0  # the next prompt index to lay out
    next_pos = 0  # the position the next text token takes
    for mm in images:
        t, h, w = (int(x) for x in mm.data["grid_thw"])
        gh, gw = h // merge_size, w // merge_size
        if t * gh * gw != mm.length:
            raise ValueError(f"an image's grid {t}x{h}x{w} does not give its {mm.length} placeholder tokens")
        text = mm.offset - cursor
        positions[:, cursor : mm.offset] = np.arange(next_pos, next_pos + text)
        base = next_pos + text
        grid = np.indices((t, gh, gw)).reshape(3, -1)
        positions[:, mm.offset : mm.end] = grid + base
        cursor = mm.end
        next_pos = base + max(t, gh, gw)
    positions[:, cursor:] = np.arange(next_pos, next_pos + num_tokens - cursor)
    delta = next_pos + num_tokens - cursor - num_tokens
    return positions, delta


def packed_mrope_positions(
    tables: Sequence[tuple[np.ndarray, int] | None], starts: Sequence[int], counts: Sequence[int]
) -> np.ndarray:
    """The packed step's positions `[3, T]`: request r's tokens `[starts[r], starts[r] + counts[r])`, read
    from its prompt's table (`mrope_positions`) and past the prompt at index + delta (the same in all three
    rows). A request without a table (no images, no M-RoPE yet) has its plain index in all three."""
    rows = []
    for table, start, count in zip(tables, starts, counts, strict=True):
        index = np.arange(start, start + count)
        if table is None:
            rows.append(np.broadcast_to(index, (3, count)))
            continue
        positions, delta = table
        known = positions.shape[1]
        out = np.broadcast_to(index + delta, (3, count)).copy()
        inside = index < known
        out[:, inside] = positions[:, index[inside]]
        rows.append(out)
    return np.concatenate(rows, axis=1).astype(np.int32)
