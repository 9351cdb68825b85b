"""Pipeline stages run one layer group's table: models needing more are refused at start-up."""

from __future__ import annotations

import pytest

from metalserve.config import ConfigError
from metalserve.distributed.setup import check_pipeline_model
from metalserve.executor.models.adapter import PagedModel
from tests.models.archs import build


def test_a_full_attention_model_is_accepted() -> None:
    check_pipeline_model(PagedModel(build("qwen3"), "qwen3"), "qwen3")


def test_a_model_with_sliding_window_groups_is_refused_naming_them() -> None:
    model = PagedModel(build("gemma3_text"), "gemma3_text")
    with pytest.raises(ConfigError, match=r"gemma3_text model keeps \d+ KV layer groups"):
        check_pipeline_model(model, "gemma3_text")
