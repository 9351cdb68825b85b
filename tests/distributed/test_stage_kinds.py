"""Pipeline stages of every KV kind, in one process (no ring): a model cut into slices, each with its own
pool planned over its own layers' specs, computes what mlx-lm's own model computes with its own caches,
over a prefill that crosses the sliding window and a decode that resumes the recurrent states.

Each stage keeps every layer group of the whole model (the scheduler's block tables) but the pool
tensors and state slots of its own layers only; the step's tables for every group reach it through the
wire's metadata (encoded and decoded here)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from metalserve.config import ConfigError
from metalserve.distributed.setup import check_pipeline_model, stage_spec
from metalserve.distributed.stage import Stage, embed_inputs, final_norm, keep_layers
from metalserve.distributed.wire import Header, Kind, StepMeta
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.compute import MlxCompute
from metalserve.executor.models.families import model_family
from metalserve.executor.models.kv_layout import stage_layout
from metalserve.kvcache.specs import FullAttention, KVCacheDtype, RecurrentState, SlidingWindow
from tests.models.archs import build
from tests.models.hybrid_tiny import tiny_hybrid
from tests.models.mla_golden import tiny_mla

BS = 8
PROMPT = [(7 * i + 3) % 250 + 5 for i in range(40)]  # 5 blocks: more than twice the 16-token window


def gemma3() -> nn.Module:  # full layers 2 and 5, sliding 0-1 and 3-4: three groups of two layers
    return build("gemma3_text", seed=4, num_hidden_layers=6, sliding_window_pattern=3)


MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "sliding": (gemma3, "gemma3_text"),
    "hybrid": (lambda: tiny_hybrid("qwen3_next", seed=5), "qwen3_next"),
    "hybrid-granite": (lambda: tiny_hybrid("granitemoehybrid", seed=6), "granitemoehybrid"),
    "hybrid-lfm2": (lambda: tiny_hybrid("lfm2", seed=7), "lfm2"),
    # The backbone elsewhere: nemotron_h's `backbone` (embeddings, norm_f), qwen3_5's under `language_model`.
    "hybrid-nemotron": (lambda: tiny_hybrid("nemotron_h", seed=10), "nemotron_h"),
    "hybrid-qwen3_5": (lambda: tiny_hybrid("qwen3_5", seed=11), "qwen3_5"),
    "hybrid-qwen3_5_moe": (lambda: tiny_hybrid("qwen3_5_moe", seed=12), "qwen3_5_moe"),
    "hybrid-lfm2_moe": (lambda: tiny_hybrid("lfm2_moe", seed=13), "lfm2_moe"),
    "mla": (lambda: tiny_mla("deepseek_v3", seed=8), "deepseek_v3"),
}
# More families' quirks at a cut after layer 1: windows read off `layer_types` by the whole model's layer
# index (ministral3, gpt-oss), other window patterns, the embedding's scale (gemma2) or multiplier (granite).
EXTRA = ("ministral3", "gpt_oss", "cohere2", "olmo3", "exaone4", "gemma2", "granite")
MODELS |= {name: ((lambda name=name: build(name, seed=9)), name) for name in EXTRA}  # type: ignore[misc]


def make_stages(kind: str, cuts: list[range], storage: KVCacheDtype = KVCacheDtype.AUTO) -> list[Stage]:
    make, model_type = MODELS[kind]
    whole = make()
    family = model_family(model_type)
    layout, states = family.kv_layout(whole), family.state_groups(whole)
    stages = []
    for k, layers in enumerate(cuts):
        model = make()
        keep_layers(model, layers, first=k == 0)
        paged = PagedModel(model, model_type, MlxCompute(), kv_layout=stage_layout(layout, layers), state_groups=states)
        stages.append(Stage(paged, stage_spec(paged, BS, storage, 64), MlxAttention()))
    return stages


def step_meta(num_groups: int, start: int, stop: int) -> StepMeta:
    """One request's tokens [start, stop), each group's table of its own block ids (through the wire)."""
    tables = [[np.asarray([60 - 6 * g - k for k in range(-(-stop // BS))])] for g in range(num_groups)]
    pos = np.arange(start, stop, dtype=np.int32)
    slots = (tables[0][0][pos // BS] * BS + pos % BS).astype(np.int32)
    meta = StepMeta(
        pos, slots, np.array([0, stop - start], np.int32), np.array([stop], np.int32), tables[0],
        np.array([stop - start - 1], np.int32), tuple(tables[1:]),
    )  # fmt: skip
    flat, width = meta.encode()
    header = Header(Kind.STEP, stop - start, 1, 1, width, 64, 0, flat.nbytes, num_groups)
    return StepMeta.decode(flat, header)


def stage_logits(stages: list[Stage], tokens: list[int], meta: StepMeta) -> mx.array:
    first = stages[0].model
    h = embed_inputs(first, mx.array(tokens))
    for stage in stages:
        h = stage.forward(h, meta)
        mx.eval(h, stage.pools())
    return first.mlx_logits(final_norm(first, h[mx.array(meta.logits_indices)]))[-1]


def reference_logits(kind: str) -> tuple[mx.array, mx.array]:
    """mlx-lm's own model and caches: the prompt's last logits, then the next token's."""
    model = MODELS[kind][0]()
    cache = make_prompt_cache(model)
    prefill = model(mx.array(PROMPT)[None], cache=cache)[0, -1]
    decode = model(mx.array([[PROMPT[-1]]]), cache=cache)[0, -1]
    return prefill, decode


CASES = [
    ("sliding", [range(0, 3), range(3, 6)]),  # each stage: the full group and one of the two sliding ones
    ("sliding", [range(0, 1), range(1, 6)]),
    ("hybrid", [range(0, 2), range(2, 4)]),  # a recurrent and an attention layer on each stage
    ("hybrid", [range(0, 1), range(1, 4)]),  # stage 0: no attention layer, no K/V pages at all
    ("hybrid", [range(0, 3), range(3, 4)]),  # stage 1: no recurrent layer
    ("hybrid-granite", [range(0, 2), range(2, 4)]),  # the embedding multiplier on rank 0
    ("hybrid-lfm2", [range(0, 3), range(3, 4)]),  # lfm2's final norm is `embedding_norm`
    ("hybrid-nemotron", [range(0, 2), range(2, 5)]),  # stage 0: a Mamba layer and an MLP-only one
    ("hybrid-qwen3_5", [range(0, 1), range(1, 4)]),
    ("hybrid-qwen3_5_moe", [range(0, 2), range(2, 4)]),
    ("hybrid-lfm2_moe", [range(0, 2), range(2, 4)]),
    ("mla", [range(0, 1), range(1, 3)]),
    *((name, [range(0, 1), range(1, len(build(name).model.layers))]) for name in EXTRA),
]


@pytest.mark.parametrize(("kind", "cuts"), CASES, ids=[f"{k}-{c[0].stop}" for k, c in CASES])
def test_stages_equal_mlx_lm(kind: str, cuts: list[range]) -> None:
    stages = make_stages(kind, cuts)
    groups = len(stages[0].spec.groups)
    prefill, decode = reference_logits(kind)
    meta = step_meta(groups, 0, len(PROMPT))
    got = stage_logits(stages, PROMPT, meta)
    assert mx.allclose(got, prefill, atol=2e-3, rtol=1e-3), float(mx.abs(got - prefill).max())
    assert_states_under_their_own_group(stages, meta)
    got = stage_logits(stages, [PROMPT[-1]], step_meta(groups, len(PROMPT), len(PROMPT) + 1))
    assert mx.allclose(got, decode, atol=2e-3, rtol=1e-3), float(mx.abs(got - decode).max())


def assert_states_under_their_own_group(stages: list[Stage], meta: StepMeta) -> None:
    """The prompt's state went to its block in the state group's table (entry (40 - 1) // 8), not to the
    block of the same entry in another group's."""
    for stage in stages:
        if stage.states is None or not stage.states.pool.arrays:
            continue
        group = stage.states.group
        mine, other = int(meta.tables()[group][0][4]), int(meta.tables()[0][0][4])
        for layer in stage.states.pool.arrays:
            for pool in layer.values():
                assert mx.any(pool[mine] != 0).item() and not mx.any(pool[other] != 0).item()


def test_each_stage_keeps_every_group_and_only_its_own_pages() -> None:
    """gemma3 with full layers 2 and 5: groups full {2, 5}, sliding {0, 1}, sliding {3, 4}. A stage of
    layers 0-2 keeps all three groups but two pool tensors (sliding 0 and 1 share them with full 2)."""
    (whole,) = make_stages("sliding", [range(0, 6)])
    first, second = make_stages("sliding", [range(0, 3), range(3, 6)])
    assert [type(g) for g in first.spec.groups] == [FullAttention, SlidingWindow, SlidingWindow]
    assert first.spec.groups == second.spec.groups == whole.spec.groups
    assert [g.layers for g in whole.spec.groups] == [(2, 5), (0, 1), (3, 4)]
    assert len(whole.spec.tensors) == len(first.spec.tensors) == len(second.spec.tensors) == 2
    assert first.model.kv_layout.layer_tensor == (0, 1, 0) and first.model.kv_layout.layer_group == (1, 1, 0)
    assert second.model.kv_layout.layer_tensor == (0, 1, 0) and second.model.kv_layout.layer_group == (2, 2, 0)
    # A group none of a stage's layers reads gets no slots or metadata built there.
    meta = step_meta(3, 0, 20)
    assert [g.metadata is None for g in first.context(meta).groups] == [False, False, True]
    assert [g.metadata is None for g in second.context(meta).groups] == [False, True, False]


def test_a_hybrid_stage_sizes_its_own_states() -> None:
    """qwen3_next: layers 0 and 2 recurrent, 1 and 3 attention. A block costs each stage its own pages
    and state slots; stage 0 of layer 0 alone keeps no K/V page, only the state slot of one layer."""
    (whole,) = make_stages("hybrid", [range(0, 4)])
    first, second = make_stages("hybrid", [range(0, 1), range(1, 4)])
    state = whole.spec.groups[-1]
    assert isinstance(state, RecurrentState) and state.layers == (0, 2)
    assert first.spec.tensors == () and len(second.spec.tensors) == 2
    assert [g.layers for g in first.spec.groups] == [g.layers for g in whole.spec.groups]
    whole_state = whole.spec.groups[-1].page_bytes(BS)
    assert first.spec.bytes_per_block * 2 == whole_state
    assert first.spec.bytes_per_block + second.spec.bytes_per_block == whole.spec.bytes_per_block


def test_a_family_the_stages_cannot_split_is_refused_naming_why() -> None:
    check_pipeline_model("gemma3_text")
    check_pipeline_model("qwen3_next")
    check_pipeline_model("deepseek_v3")
    with pytest.raises(ConfigError, match="gemma4_text model cannot be split into stages yet: its layers take"):
        check_pipeline_model("gemma4_text")
    with pytest.raises(ConfigError, match="qwen2_vl model cannot be split into stages yet: images are not sent"):
        check_pipeline_model("qwen2_vl")


@pytest.mark.parametrize("name", ["ministral3", "gpt_oss"])
def test_a_slice_reads_layer_types_by_the_whole_models_layer_index(name: str) -> None:
    """Windows from `layer_types` (the whole model's list) land on the right layers of a later slice."""
    (whole,) = make_stages(name, [range(0, 4)])
    first, second = make_stages(name, [range(0, 1), range(1, 4)])
    windows = [layer.self_attn.options.sliding_window for layer in whole.model.backbone.layers]
    assert windows[0] is not None and None in windows  # the tiny configs mix both kinds
    sliced = [layer.self_attn.options.sliding_window for s in (first, second) for layer in s.model.backbone.layers]
    assert sliced == windows


@pytest.mark.parametrize("kind", ["sliding", "hybrid"])
def test_int8_pages_split_as_the_whole_model_keeps_them(kind: str) -> None:
    """--kv-cache-dtype int8: each stage quantizes its own layers' pages as one stage of all layers does."""
    n = 6 if kind == "sliding" else 4
    (whole,) = make_stages(kind, [range(0, n)], KVCacheDtype.INT8)
    stages = make_stages(kind, [range(0, 2), range(2, n)], KVCacheDtype.INT8)
    assert stages[1].spec.page.storage == "int8"
    groups = len(whole.spec.groups)
    for start, stop, tokens in ((0, len(PROMPT), PROMPT), (len(PROMPT), len(PROMPT) + 1, [PROMPT[-1]])):
        meta = step_meta(groups, start, stop)
        want = stage_logits([whole], tokens, meta)
        assert mx.allclose(stage_logits(stages, tokens, meta), want, atol=1e-4), start
