"""What the generic adapter reads off mlx-lm's modules, and what it refuses."""

from __future__ import annotations

import pytest

from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.attention_traits import AttentionTraits, all_traits
from metalserve.executor.models.families import SUPPORTED_MODEL_TYPES
from metalserve.executor.models.kv_layout import layout_of
from tests.models.archs import WINDOW, build


def test_traits_spell_each_familys_facts_alike() -> None:
    gpt = all_traits(build("gpt_oss"))
    assert [t.window for t in gpt] == [WINDOW, None, WINDOW, None] and all(t.has_sinks for t in gpt)
    assert gpt[0].scale == pytest.approx(16**-0.5) and (gpt[0].n_heads, gpt[0].n_kv_heads) == (4, 2)
    granite = all_traits(build("granite"))[0]
    assert granite.scale == pytest.approx(0.2) and granite.window is None and not granite.has_sinks
    gemma3 = all_traits(build("gemma3_text"))
    assert [t.window for t in gemma3] == [WINDOW, None, WINDOW, None]
    assert gemma3[0].scale == pytest.approx(16**-0.5)  # query_pre_attn_scalar, not head_dim
    gemma4 = all_traits(build("gemma4_text"))
    assert [t.kv_source for t in gemma4] == [0, 1, 0, 1] and gemma4[1].head_dim == 32
    assert all_traits(build("gemma2"))[0].softcap == 5.0


def test_dynamic_ntk_rope_and_uncovered_types_are_refused() -> None:
    model = build("llama", rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic NTK"):
        PagedModel(model, "llama")
    with pytest.raises(ValueError, match=r"'gpt_neox' is not supported.*gemma3_text"):
        PagedModel(build("llama"), "gpt_neox")
    assert len(set(SUPPORTED_MODEL_TYPES)) == len(SUPPORTED_MODEL_TYPES)


def test_a_group_needs_one_kv_shape() -> None:
    def t(i: int, heads: int) -> AttentionTraits:
        return AttentionTraits(i, 4, heads, 16, 0.25, None, None, False, i)

    with pytest.raises(ValueError, match="share a window but not a KV shape"):
        layout_of([t(0, 2), t(1, 1)])
