"""The pure parts of bench/spec_decode.py: the edit workload from the repository, and the table."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import spec_decode  # noqa: E402


def test_edit_prompts_hold_repository_code_and_rename_a_name_it_uses() -> None:
    prompts = spec_decode.edit_prompts(8)
    assert len(prompts) == 8 and len(set(prompts)) > 4
    for p in prompts:
        head, code = p.split("\n", 1)
        old = head.split("`")[1]
        assert old in code and old not in spec_decode.BUILTINS
        assert "def " in code or "class " in code


def test_identifiers_prefer_names_used_twice() -> None:
    code = "def f(alpha, beta):\n    gamma = alpha + beta\n    return alpha * len(gamma)\n"
    assert spec_decode.identifiers(code) == ["alpha", "beta", "gamma"]


def test_the_table_shows_the_speed_up_of_each_on_arm() -> None:
    base = {"mean_tpot_ms": 10.0, "mean_cpu_tpot_ms": 9.0, "mean_ttft_s": 1.0, "draft_tokens": 0}
    rows = [
        {
            "workload": "edit",
            "concurrency": 1,
            "speculation": "off",
            "output_tok_s": 20.0,
            "output_tok_per_cpu_s": 10.0,
            "acceptance_rate": None,
            "mean_acceptance_length": None,
            **base,
        },
        {
            "workload": "edit",
            "concurrency": 1,
            "speculation": "on",
            "output_tok_s": 35.0,
            "output_tok_per_cpu_s": 12.0,
            "acceptance_rate": 0.8,
            "mean_acceptance_length": 3.2,
            **base,
        },
    ]
    table = spec_decode.markdown(rows)
    assert "| edit | 1 | on | 35.0 | 12.0 | 10.0 | 9.0 | 1.00 | 80% | 3.20 | 1.75x | 1.20x |" in table


def test_repetitions_aggregate_to_tokens_over_wall_time() -> None:
    def row(arm: str, tokens: int, wall: float, drafted: int, rate: float | None) -> dict[str, object]:
        return {
            "workload": "chat",
            "concurrency": 8,
            "speculation": arm,
            "output_tokens": tokens,
            "wall_s": wall,
            "cpu_s": wall / 2,
            "mean_tpot_ms": 10.0,
            "mean_cpu_tpot_ms": 9.0,
            "mean_ttft_s": 1.0,
            "draft_tokens": drafted,
            "acceptance_rate": rate,
            "mean_acceptance_length": None if rate is None else 1.5,
        }

    (on,) = spec_decode.aggregate([row("on", 100, 2.0, 10, 0.5), row("on", 100, 8.0, 30, 0.1)])
    assert on["output_tok_s"] == 20.0 and on["output_tok_per_cpu_s"] == 40.0 and on["draft_tokens"] == 40
    assert abs(on["acceptance_rate"] - (5 + 3) / 40) < 1e-12
