"""Which attention the engine runs: --attention-backend against the machine and the model's dtype."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metalserve.config import ConfigError
from metalserve.engine.core import CPU, PORTABLE, select_attention

needs_no_metal = pytest.mark.skipif(mx.metal.is_available(), reason="these rows are about a machine without Metal")


@needs_no_metal
def test_auto_takes_the_cpu_path_for_float32_and_the_portable_path_otherwise() -> None:
    assert select_attention("auto", mx.float32) == CPU
    assert select_attention("auto", mx.float16) == PORTABLE


def test_reference_is_the_portable_path_everywhere() -> None:
    assert select_attention("reference", mx.float32) == PORTABLE


def test_cpu_refuses_half_precision_with_a_reason() -> None:
    with pytest.raises(ConfigError, match="float32"):
        select_attention("cpu", mx.bfloat16)


@needs_no_metal
def test_metal_without_a_metal_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Metal"):
        select_attention("metal", mx.float32)
