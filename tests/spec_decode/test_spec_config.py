"""`--speculative-config`: vLLM's JSON accepted, anything that cannot work refused at start-up."""

from __future__ import annotations

import pytest

from metalserve.api.server import add_cli_args, config_from_args
from metalserve.speculative_config import SpeculativeConfig, SpeculativeConfigError


def parse(argv: list[str]):  # type: ignore[no-untyped-def]
    import argparse

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return config_from_args(parser.parse_args(argv))[0]


def test_the_flag_maps_onto_the_engine_config() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}'
    config = parse(["--max-num-batched-tokens", "64", "--speculative-config", spec])
    assert config.speculative_config == SpeculativeConfig("ngram", 3, 1, 5)
    assert parse(["--max-num-batched-tokens", "64"]).speculative_config is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "unknown method 'medusa'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be 1..16"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be 1..16"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_max (2) is less than prompt_lookup_min (4)",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min must be"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown keys for ngram: lookahead"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        (
            '{"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_min": 1}',
            "unknown keys for draft_model: prompt_lookup_min",
        ),
        ("[1, 2]", "must be a JSON object"),
        ("{method: ngram}", "not valid JSON"),
    ],
)
def test_bad_configs_fail_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(SpeculativeConfigError) as info:
        SpeculativeConfig.from_json(text)
    assert message in str(info.value)


def test_the_serve_command_reports_a_bad_config_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    from metalserve.cli import main

    bad = '{"method": "ngram", "num_speculative_tokens": -1}'
    rc = main(["serve", "--max-num-batched-tokens", "64", "--speculative-config", bad])
    assert rc == 1
    assert "num_speculative_tokens must be 1..16" in capsys.readouterr().err
