"""`--models FILE` (YAML or JSON) and several model arguments: names, aliases, per-model options, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metalserve.api.served_models import model_specs, single_model_spec, with_kv_share
from metalserve.api.server import config_from_args
from metalserve.cli import build_parser
from metalserve.config import ConfigError, EngineConfig
from metalserve.serving.model_spec import build_specs, read_models_file, served_names

YAML = """
- model: /models/coder.gguf
  served_model_name: coder
  aliases: [claude-sonnet, gpt-4o]
  max_model_len: 4096
  chat_template: "{{ messages }}"
  tool_call_parser: hermes
  enable_auto_tool_choice: true
  reasoning_parser: qwen3
  speculative_config: {method: ngram, num_speculative_tokens: 3}
  pinned: true
- name: small
  kv_cache_memory: 1000000
"""


def test_yaml_file_gives_names_aliases_and_per_model_options(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(YAML)
    base = EngineConfig(max_num_seqs=8)
    coder, small = build_specs(read_models_file(str(path)), base)
    assert coder.names == ("coder", "claude-sonnet", "gpt-4o") and coder.pinned
    assert coder.config.model == "/models/coder.gguf" and coder.config.max_model_len == 4096
    assert coder.config.max_num_seqs == 8  # the command line's options are the base
    assert coder.config.speculative_config is not None and coder.config.speculative_config.num_speculative_tokens == 3
    assert coder.config.tool_call_parser == "hermes" and coder.enable_auto_tool_choice
    assert coder.reasoning_parser == "qwen3" and coder.config.chat_template == "{{ messages }}"
    assert small.config.model is None and small.names == ("small",) and not small.pinned
    assert small.config.kv_cache_memory == 1000000
    json_path = tmp_path / "models.json"
    json_path.write_text(json.dumps([{"model": "x.gguf", "aliases": "y"}]))
    [only] = build_specs(read_models_file(str(json_path)), base)
    assert only.names == ("x.gguf", "y")


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"model": "a", "max_tokens": 3}], "unknown keys max_tokens"),
        ([{"model": "a"}, {"model": "b", "aliases": ["a"]}], "the name 'a' is used by two models"),
        ([{"model": "a", "block_size": 7}], "--block-size must be 8, 16 or 32"),
        ([{"model": "a", "enable_auto_tool_choice": True}], "enable_auto_tool_choice needs tool_call_parser"),
        ([{"model": "a", "pinned": "yes"}], "take true or false"),
        ([42], "expected a path or a mapping"),
    ],
)
def test_bad_entries_are_refused_with_the_entry_named(entries: list[object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_specs(entries, EngineConfig())


def test_several_model_arguments_and_pins_from_the_command_line(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"")
    argv = ["serve", str(gguf), "hub/model", "--pinned-models", "tiny", "--model-idle-timeout", "5"]
    config, settings = config_from_args(build_parser().parse_args(argv))
    assert config.model == str(gguf) and settings.more_models == ("hub/model",)
    assert settings.multi_model and settings.model_idle_timeout == 5
    first, second = model_specs(config, settings)
    assert first.names == ("tiny", str(gguf)) and first.pinned and second.names == ("hub/model",)
    assert first.config.model == str(gguf) and second.config.model == "hub/model"
    shared = with_kv_share(second, budget=8000, num_models=2)
    assert shared.config.kv_cache_memory == 2000  # half the budget, shared equally by the pools
    args = build_parser().parse_args(["serve", "a", "b", "--pinned-models", "c"])
    with pytest.raises(ConfigError, match="--pinned-models c: no such served model"):
        model_specs(*config_from_args(args))


def test_served_model_name_once_per_model_argument_in_order() -> None:
    """vLLM's --served-model-name (an id, then aliases), given once per model argument."""
    argv = ["serve", "a", "b", "c", "--served-model-name", "x", "--served-model-name", "y", "y-alias"]
    first, second, third = model_specs(*config_from_args(build_parser().parse_args(argv)))
    assert first.names == ("x",) and second.names == ("y", "y-alias") and third.names == ("c",)
    assert (first.config.model, second.config.model) == ("a", "b")
    too_many = ["serve", "a", "b", "--served-model-name", "x", "--served-model-name", "y", "--served-model-name", "z"]
    with pytest.raises(ConfigError, match="given 3 times for 2 model argument"):
        model_specs(*config_from_args(build_parser().parse_args(too_many)))
    two_for_one = build_parser().parse_args(["serve", "a", "--served-model-name", "x", "--served-model-name", "y"])
    with pytest.raises(ConfigError, match="given 2 times for one model"):
        single_model_spec(*config_from_args(two_for_one))
    with pytest.raises(ValueError, match="names must not be empty"):
        config_from_args(build_parser().parse_args(["serve", "a", "--served-model-name", ""]))


def test_default_served_names_are_readable_and_keep_the_old_ids_as_aliases(tmp_path: Path) -> None:
    gguf = tmp_path / "Qwen3-8B-Q4_K_M.gguf"
    gguf.write_bytes(b"")
    directory = tmp_path / "smollm2-360m"
    directory.mkdir()
    assert served_names(str(gguf)) == ("Qwen3-8B-Q4_K_M", str(gguf))  # the path as written was the old id
    relative = Path("..") / tmp_path.name / directory.name
    assert served_names(str(tmp_path / relative)) == ("smollm2-360m", str(tmp_path / relative), str(directory))
    assert served_names("mlx-community/Qwen3-8B-4bit") == ("mlx-community/Qwen3-8B-4bit",)  # a hub id as written
    assert served_names(None) == ("SmolLM2-135M-Instruct.Q4_1",)  # the embedded default
    assert served_names(str(gguf), ["qwen", "gpt-4o"]) == ("qwen", "gpt-4o")  # given names replace them


def test_one_model_argument_serves_as_before() -> None:
    config, settings = config_from_args(build_parser().parse_args(["serve", "some.gguf"]))
    assert config.model == "some.gguf" and not settings.multi_model and settings.more_models == ()
    config, settings = config_from_args(build_parser().parse_args(["serve"]))
    assert config.model is None and not settings.multi_model
    with pytest.raises(ValueError, match="--pinned-models is for several models"):
        config_from_args(build_parser().parse_args(["serve", "--pinned-models", "x"]))
