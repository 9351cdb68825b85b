"""`metalserve serve`'s flags, generated from the config fields: every flag parses onto its field, the names
stay the ones users type, and the generator's type rules hold."""

from __future__ import annotations

import argparse
import dataclasses
from enum import StrEnum
from pathlib import Path
from typing import Literal

import pytest

from metalserve.api.server import add_cli_args, config_from_args, default_token_budget
from metalserve.api.settings import ServerSettings
from metalserve.cli import main
from metalserve.config import ConfigError, EngineConfig, SchedulingPolicy, WeightsMode
from metalserve.flags import add_flags, build, flag, flag_fields, flag_group, flag_values
from metalserve.kvcache.specs import BLOCK_SIZES, KVCacheDtype
from metalserve.multimodal.limits import ImageLimits
from metalserve.speculative_config import SpeculativeConfig
from metalserve.structured.limits import GrammarLimits

# `serve`'s option strings as released: renaming or dropping one breaks users' command lines.
SERVE_OPTIONS = {
    "--served-model-name",
    "--cpu-int8-activations",
    "--enable-lora",
    "--lora-modules",
    "--max-loras",
    "--max-lora-rank",
    "--max-model-len",
    "--block-size",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--long-prefill-token-threshold",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--scheduling-policy",
    "--gpu-memory-utilization",
    "--kv-cache-memory",
    "--weights",
    "--attention-backend",
    "--chat-template",
    "--seed",
    "--pipeline-parallel-size",
    "-pp",
    "--pipeline-layer-partition",
    "--pipeline-step-timeout",
    "--speculative-config",
    "--host",
    "--port",
    "--api-key",
    "--log-stats-interval",
    "--tool-call-parser",
    "--reasoning-parser",
    "--responses-store-size",
    "--enable-auto-tool-choice",
    "--graceful-shutdown-timeout",
    "--max-request-body-bytes",
    "--allowed-origins",
    "--allow-credentials",
    "--allowed-methods",
    "--allowed-headers",
    "--kv-cache-dtype",
    # Issue 28's bounds: grammar size, compile time and cache; the Responses store's bytes; body arrival.
    "--max-grammar-bytes",
    "--grammar-compile-timeout",
    "--grammar-cache-bytes",
    "--responses-store-bytes",
    "--request-body-timeout",
    # Images in (issue 30): the encoder's budget and cache, the per-request image limits.
    "--max-num-encoder-input-tokens",
    "--encoder-cache-size",
    "--max-images-per-request",
    "--max-image-pixels",
    "--max-image-bytes-per-request",
    # Several models (docs/multi-model.md).
    "--models",
    "--pinned-models",
    "--model-idle-timeout",
    "--model-load-timeout",
    "--memory-budget",
    # Issue 27's: a longer context on request, the output cap for requests without one, the generic tool prompt.
    "--hf-overrides",
    "--allow-long-max-model-len",
    "--default-max-tokens",
    "--generic-tool-prompt",
    "--no-generic-tool-prompt",
    # The KV disk tier (docs/disk-tier.md) and async scheduling (docs/serving.md).
    "--kv-disk-dir",
    "--kv-disk-size",
    "--async-scheduling",
    "--no-async-scheduling",
}


MULTI = {"more_models", "models", "pinned_models", "model_idle_timeout", "model_load_timeout", "memory_budget"}
PIPELINE = {"pipeline_parallel_size", "pipeline_layer_partition", "tensor_parallel_size"}  # refused with speculation
DISK = {"kv_disk_dir", "kv_disk_size"}  # need prefix caching, which the first command line turns off


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser


def test_the_serve_flags_keep_their_names() -> None:
    options = {s for action in _parser()._actions for s in action.option_strings} - {"-h", "--help"}
    assert options >= SERVE_OPTIONS
    positionals = [a.dest for a in _parser()._actions if not a.option_strings]
    assert positionals == ["model", "more_models"]  # `serve A B C`: A, then the rest


def test_every_flag_lands_on_its_field(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}'
    argv = [
        "m.gguf",
        "--served-model-name",
        "served",
        "--max-model-len",
        "4096",
        "--block-size",
        "32",
        "--max-num-seqs",
        "7",
        "--max-num-batched-tokens",
        "300",
        "--long-prefill-token-threshold",
        "64",
        "--no-enable-prefix-caching",
        "--scheduling-policy",
        "priority",
        "--gpu-memory-utilization",
        "0.75",
        "--kv-cache-memory",
        "123456",
        "--kv-cache-dtype",
        "int8",
        "--weights",
        "quantized",
        "--attention-backend",
        "mlx",
        "--chat-template",
        str(template),
        "--seed",
        "9",
        "--pipeline-step-timeout",
        "5.5",
        "--speculative-config",
        spec,
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--api-key",
        "k",
        "--log-stats-interval",
        "2.5",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--responses-store-size",
        "3",
        "--enable-auto-tool-choice",
        "--graceful-shutdown-timeout",
        "4",
        "--max-request-body-bytes",
        "2048",
        "--allowed-origins",
        '["http://a.example"]',
        "--allow-credentials",
        "--allowed-methods",
        '["GET", "POST"]',
        "--allowed-headers",
        '["x-h"]',
        "--responses-store-bytes",
        "4096",
        "--max-grammar-bytes",
        "5000",
        "--grammar-compile-timeout",
        "2.5",
        "--grammar-cache-bytes",
        "65536",
        "--request-body-timeout",
        "7.5",
        "--max-num-encoder-input-tokens",
        "999",
        "--encoder-cache-size",
        "2000",
        "--max-images-per-request",
        "2",
        "--max-image-pixels",
        "1000",
        "--max-image-bytes-per-request",
        "5000",
        "--hf-overrides",
        '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}',
        "--allow-long-max-model-len",
        "--enable-lora",
        "--lora-modules",
        "sql=/adapters/sql",
        "chat=/adapters/chat",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "32",
        "--default-max-tokens",
        "77",
        "--no-generic-tool-prompt",
        "--no-tool-call-grammar",
        "--cpu-int8-activations",
        "auto",
        "--cpu-bf16-prefill",
        "on",
        "--override-generation-config",
        '{"temperature": 0.7, "top_k": 20}',
        "--no-async-scheduling",
        "--runner",
        "pooling",
        "--pooling-type",
        "mean",
    ]
    # A new flag gets a value here too: every flag is parsed onto its field by this test.
    given = {a.dest for a in _parser()._actions if {*a.option_strings} & set(argv)} | {"model"}
    every_field = {f.name for cls in (EngineConfig, ServerSettings) for f, _ in flag_fields(cls)}
    assert given >= every_field - PIPELINE - MULTI - DISK
    config, settings = config_from_args(_parser().parse_args(argv))
    assert config == EngineConfig(
        model="m.gguf",
        max_model_len=4096,
        block_size=32,
        max_num_seqs=7,
        max_num_batched_tokens=300,
        long_prefill_token_threshold=64,
        enable_prefix_caching=False,
        scheduling_policy="priority",
        gpu_memory_utilization=0.75,
        kv_cache_memory=123456,
        kv_cache_dtype="int8",
        weights="quantized",
        attention_backend="mlx",
        chat_template="{{ messages[0].content }}",
        tool_call_parser="hermes",
        seed=9,
        pipeline_step_timeout=5.5,
        speculative_config=SpeculativeConfig("ngram", 3, 1, 5),
        max_num_encoder_input_tokens=999,
        encoder_cache_size=2000,
        hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        allow_long_max_model_len=True,
        async_scheduling=False,
        enable_lora=True,
        lora_modules=(("sql", "/adapters/sql"), ("chat", "/adapters/chat")),
        max_loras=3,
        max_lora_rank=32,
        runner="pooling",
        pooling_type="mean",
    )
    assert settings == ServerSettings(
        host="0.0.0.0",
        port=9001,
        api_key="k",
        served_model_name=(("served",),),
        log_stats_interval=2.5,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        responses_store_size=3,
        enable_auto_tool_choice=True,
        graceful_shutdown_timeout=4.0,
        max_request_body_bytes=2048,
        allowed_origins=("http://a.example",),
        allow_credentials=True,
        allowed_methods=("GET", "POST"),
        allowed_headers=("x-h",),
        responses_store_bytes=4096,
        grammar=GrammarLimits(max_grammar_bytes=5000, grammar_compile_timeout=2.5, grammar_cache_bytes=65536),
        request_body_timeout=7.5,
        images=ImageLimits(max_images_per_request=2, max_image_pixels=1000, max_image_bytes_per_request=5000),
        default_max_tokens=77,
        generic_tool_prompt=False,
        tool_call_grammar=False,
        cpu_int8_activations="auto",
        cpu_bf16_prefill="on",
        override_generation_config=(("temperature", 0.7), ("top_k", 20.0)),
    )
    config, _ = config_from_args(_parser().parse_args(["--kv-disk-dir", "/tmp/kv", "--kv-disk-size", "4096"]))
    assert (config.kv_disk_dir, config.kv_disk_size) == ("/tmp/kv", 4096)
    # Several models cannot combine with --served-model-name: a command line of their own.
    argv = [
        "a.gguf",
        "b.gguf",
        "c",
        "--models",
        "m.yaml",
        "--pinned-models",
        "a.gguf, c",
        "--model-idle-timeout",
        "9",
        "--model-load-timeout",
        "8",
        "--memory-budget",
        "1000",
    ]
    config, settings = config_from_args(_parser().parse_args(argv))
    assert config.model == "a.gguf" and settings.more_models == ("b.gguf", "c") and settings.models == "m.yaml"
    assert settings.pinned_models == ("a.gguf", "c") and settings.memory_budget == 1000
    assert (settings.model_idle_timeout, settings.model_load_timeout) == (9.0, 8.0)
    # Pipeline flags cannot combine with speculation, so they get a command line of their own.
    config, _ = config_from_args(_parser().parse_args(["-pp", "2", "--pipeline-layer-partition", "10,20"]))
    assert (config.pipeline_parallel_size, config.pipeline_layer_partition) == (2, (10, 20))


def test_absent_flags_are_the_field_defaults() -> None:
    config, settings = config_from_args(_parser().parse_args([]))
    assert config == EngineConfig(max_num_batched_tokens=default_token_budget())
    assert settings == ServerSettings()


def test_a_flag_value_that_cannot_work_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--allowed-origins", '{"a": 1}']) == 1
    assert "--allowed-origins takes a JSON list of strings" in capsys.readouterr().err
    assert main(["serve", "--allowed-methods", "not json"]) == 1
    assert "--allowed-methods takes a JSON list of strings" in capsys.readouterr().err
    assert main(["serve", "--hf-overrides", "[1]"]) == 1
    assert "--hf-overrides takes a JSON object" in capsys.readouterr().err
    assert main(["serve", "--pipeline-layer-partition", "1,x", "-pp", "2"]) == 1
    assert "--pipeline-layer-partition takes comma-separated layer counts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--weights", "fp8"])  # not one of the Literal's values
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--attention-backend", "reference"])  # the MLX-ops backend's old name: no alias
    assert "invalid choice: 'reference' (choose from" in capsys.readouterr().err


def test_help_lists_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(option in text for option in SERVE_OPTIONS)
    assert "most requests in one batch (default: 64)" in text
    assert 'CORS, JSON list (default: ["*"])' in text


@dataclasses.dataclass(frozen=True)
class _Toy:
    """A config for the generator's own rules."""

    on: bool = flag(True, "a switch that starts on")
    off: bool = flag(False, "a switch that starts off")
    mode: Literal["a", "b"] = flag("a", "a literal")
    ratio: float = flag(0.5, "a float")
    name: str | None = flag(None, "an optional string")
    pair: tuple[int, int] = flag((1, 2), "a parsed value", parse=lambda t: tuple(int(x) for x in t.split("x")))
    hidden: int = 3  # a plain default: not a flag


def _toy(*argv: str) -> _Toy:
    parser = argparse.ArgumentParser()
    add_flags(parser, _Toy)
    return build(_Toy, flag_values(parser.parse_args(list(argv)), _Toy))


def test_the_generator_derives_each_argument_from_the_field_type() -> None:
    assert _toy() == _Toy()
    assert _toy("--no-on", "--off", "--mode", "b", "--ratio", "2", "--name", "x", "--pair", "3x4") == _Toy(
        on=False, off=True, mode="b", ratio=2.0, name="x", pair=(3, 4)
    )
    with pytest.raises(SystemExit):
        _toy("--no-off")  # a switch that starts off has no --no- form
    with pytest.raises(SystemExit):
        _toy("--mode", "c")
    with pytest.raises(SystemExit):
        _toy("--hidden", "4")


def test_a_flag_type_the_generator_cannot_read_fails_when_the_parser_is_built() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bad:
        """A flag of a type with no rule and no parse=."""

        sizes: list[int] = flag((), "no rule for lists")

    with pytest.raises(TypeError, match=r"Bad.sizes: a flag of type list\[int\] needs parse="):
        add_flags(argparse.ArgumentParser(), Bad)


def test_one_flag_declared_by_both_configs_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Clash:
        """Declares --port again."""

        port: int = flag(1, "a second --port")

    with pytest.raises(argparse.ArgumentError, match="--port"):
        add_flags(argparse.ArgumentParser(), ServerSettings, Clash)


@pytest.mark.parametrize(
    ("field", "enum"),
    [("scheduling_policy", SchedulingPolicy), ("kv_cache_dtype", KVCacheDtype), ("weights", WeightsMode)],
)
def test_an_enum_field_offers_its_values_and_holds_the_member(field: str, enum: type[StrEnum]) -> None:
    """The CLI's choices come from the enum; a value given as text (a models file) becomes the member."""
    option = next(a for a in _parser()._actions if a.dest == field)
    assert option.choices == [member.value for member in enum]
    last = list(enum)[-1]
    config = EngineConfig(**{field: last.value})  # type: ignore[arg-type]
    assert getattr(config, field) is last
    assert getattr(config_from_args(_parser().parse_args([option.option_strings[0], last.value]))[0], field) is last
    with pytest.raises(ConfigError, match=f"{option.option_strings[0]} must be one of {', '.join(enum)}, got 'x'"):
        EngineConfig(**{field: "x"})  # type: ignore[arg-type]


def test_block_sizes_are_one_fact() -> None:
    option = next(a for a in _parser()._actions if a.dest == "block_size")
    assert tuple(option.choices) == BLOCK_SIZES
    with pytest.raises(ConfigError, match="--block-size must be 8, 16 or 32, got 12"):
        EngineConfig(block_size=12)


@dataclasses.dataclass(frozen=True)
class _ToyLimits:
    """Limits that declare their own flags."""

    most: int = flag(3, "a limit")
    plain: int = 1  # not a flag


@dataclasses.dataclass(frozen=True)
class _ToyOwner:
    """A config that nests the limits."""

    before: int = flag(0, "declared before the group")
    limits: _ToyLimits = flag_group(_ToyLimits)
    after: int = flag(0, "declared after the group")


def test_a_flag_group_joins_its_owner_in_place() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, _ToyOwner)
    assert [a.dest for a in parser._actions[1:]] == ["before", "most", "after"]  # the group's flags in its place
    assert build(_ToyOwner, flag_values(parser.parse_args([]), _ToyOwner)) == _ToyOwner()
    built = build(_ToyOwner, flag_values(parser.parse_args(["--most", "5", "--after", "1"]), _ToyOwner))
    assert built == _ToyOwner(limits=_ToyLimits(most=5), after=1)
    # ServerSettings nests the image and grammar limits: each default is written once, in its dataclass.
    settings_flags = {f.name: f.default for f, _ in flag_fields(ServerSettings)}
    assert (
        settings_flags["max_image_pixels"] == ImageLimits().max_image_pixels == ServerSettings().images.max_image_pixels
    )
    assert settings_flags["max_grammar_bytes"] == GrammarLimits().max_grammar_bytes
