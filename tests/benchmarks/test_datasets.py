"""Datasets: exact lengths with a word tokenizer, shared prefixes, file formats and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metalserve.benchmarks.datasets import DatasetError, DatasetSpec, build_sessions
from tests.benchmarks.word_tokenizer import WordTokenizer

TOK = WordTokenizer()


def test_random_lengths_are_exact_and_prompts_fresh() -> None:
    sessions = build_sessions(DatasetSpec("random", input_len=30, output_len=7), TOK, 5, seed=0)
    assert [len(s.turns[0].text.split()) for s in sessions] == [30] * 5
    assert all(s.turns[0].prompt_len == 30 and s.turns[0].output_len == 7 for s in sessions)
    assert len({s.turns[0].text for s in sessions}) == 5
    other = build_sessions(DatasetSpec("random", input_len=30, output_len=7), TOK, 5, seed=1)
    assert {s.turns[0].text for s in sessions}.isdisjoint(s.turns[0].text for s in other)


def test_random_range_ratio_and_shared_prefix() -> None:
    spec = DatasetSpec("random", input_len=40, output_len=20, range_ratio=0.5, prefix_len=10)
    sessions = build_sessions(spec, TOK, 30, seed=2)
    for s in sessions:
        t = s.turns[0]
        assert 10 + 20 <= t.prompt_len <= 10 + 60 and 10 <= t.output_len <= 30
        assert t.prompt_len == len(t.text.split())
    heads = {" ".join(s.turns[0].text.split()[:10]) for s in sessions}
    assert len(heads) == 1
    assert len({s.turns[0].prompt_len for s in sessions}) > 3


def test_sonnet_uses_file_lines(tmp_path: Path) -> None:
    poem = tmp_path / "sonnet.txt"
    poem.write_text("\n".join(f"line {i} of the poem here" for i in range(40)), encoding="utf-8")
    spec = DatasetSpec("sonnet", path=str(poem), input_len=60, output_len=5, prefix_len=20)
    sessions = build_sessions(spec, TOK, 3, seed=0)
    for s in sessions:
        t = s.turns[0]
        assert t.text.startswith("Pick as many lines")
        assert 60 - 6 <= t.prompt_len <= 60  # whole lines of 6 words
        assert "line 0 of the poem here" in t.text  # the shared head
    with pytest.raises(DatasetError, match="dataset-path"):
        build_sessions(DatasetSpec("sonnet"), TOK, 1, seed=0)


def test_sharegpt_filters_and_counts(tmp_path: Path) -> None:
    convo = [
        {"from": "human", "value": "tell me a long story please"},
        {"from": "gpt", "value": "once upon a time"},
    ]
    entries = [{"conversations": convo}] * 3 + [{"conversations": [{"from": "human", "value": "hi"}] * 2}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    sessions = build_sessions(DatasetSpec("sharegpt", path=str(path)), TOK, 3, seed=0)
    assert [(s.turns[0].prompt_len, s.turns[0].output_len) for s in sessions] == [(6, 4)] * 3
    with pytest.raises(DatasetError, match="only 3 usable"):
        build_sessions(DatasetSpec("sharegpt", path=str(path)), TOK, 4, seed=0)


def test_agent_conversations_share_one_system_prompt() -> None:
    spec = DatasetSpec("agent", input_len=12, output_len=6, agent_turns=3, agent_system_len=50)
    sessions = build_sessions(spec, TOK, 4, seed=0)
    assert {s.system for s in sessions} == {sessions[0].system}
    assert sessions[0].system_len == 50
    assert all(len(s.turns) == 3 and all(t.prompt_len == 12 for t in s.turns) for s in sessions)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (DatasetSpec("nope"), "unknown dataset"),
        (DatasetSpec("random", input_len=0), "input-len"),
        (DatasetSpec("random", range_ratio=1.5), "range-ratio"),
        (DatasetSpec("agent", agent_turns=0), "agent-turns"),
    ],
)
def test_bad_specs_raise(spec: DatasetSpec, match: str) -> None:
    with pytest.raises(DatasetError, match=match):
        build_sessions(spec, TOK, 2, seed=0)
