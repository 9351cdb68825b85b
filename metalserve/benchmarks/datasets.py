"""The datasets: `random`, `sonnet`, `sharegpt` and the multi-turn `agent`; each returns Sessions."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from metalserve.benchmarks.samples import Session, Turn, single
from metalserve.benchmarks.text_fill import fit_words, random_text
from metalserve.benchmarks.tokenizer import TokenCounter

DATASETS = ("random", "sonnet", "sharegpt", "agent")


class DatasetError(ValueError):
    """A dataset that cannot be built from the given flags or file."""


@dataclass(frozen=True)
class DatasetSpec:
    """The dataset flags, gathered once from the command line."""

    name: str = "random"
    path: str | None = None
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 0  # random/sonnet: tokens shared by every prompt
    sharegpt_output_len: int | None = None
    agent_turns: int = 4
    agent_system_len: int = 1024


def _scaled(rng: random.Random, base: int, ratio: float) -> int:
    """A length drawn uniformly from [base*(1-ratio), base*(1+ratio)], at least 1."""
    lo, hi = int(base * (1 - ratio)), int(base * (1 + ratio))
    return max(1, rng.randint(lo, hi))


def random_sessions(spec: DatasetSpec, tok: TokenCounter, num: int, seed: int) -> list[Session]:
    """`num` prompts of fresh nonsense words of the asked lengths (optionally after a shared prefix)."""
    if not 0.0 <= spec.range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {spec.range_ratio}")
    rng = random.Random(seed)
    prefix, prefix_len = random_text(tok, random.Random(seed ^ 0x5EED), spec.prefix_len) if spec.prefix_len else ("", 0)
    sessions = []
    for _ in range(num):
        text, n = random_text(tok, rng, _scaled(rng, spec.input_len, spec.range_ratio))
        out_len = _scaled(rng, spec.output_len, spec.range_ratio)
        full = f"{prefix} {text}" if prefix else text
        sessions.append(single(full, prefix_len + n, out_len))
    return sessions


_SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"


def sonnet_sessions(spec: DatasetSpec, tok: TokenCounter, num: int, seed: int) -> list[Session]:
    """Prompts of poem lines: a shared head of `prefix_len` tokens, then random lines up to `input_len`."""
    if not spec.path:
        raise DatasetError("the sonnet dataset needs --dataset-path (a text file, one line per verse)")
    lines = [ln for ln in Path(spec.path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    if len(lines) < 2:
        raise DatasetError(f"{spec.path} has fewer than 2 non-empty lines")
    head_len = len(tok.encode(_SONNET_INSTRUCTION))
    if spec.input_len <= head_len + spec.prefix_len:
        raise DatasetError(f"--input-len must exceed the instruction ({head_len}) plus --prefix-len tokens")
    prefix = fit_words(tok, lines + lines, spec.prefix_len, sep="\n")[0] if spec.prefix_len else ""
    rng = random.Random(seed)
    sessions = []
    for _ in range(num):
        picked = [rng.choice(lines) for _ in range(spec.input_len)]  # each line is >= 1 token
        head = _SONNET_INSTRUCTION + (prefix + "\n" if prefix else "")
        body, _ = fit_words(tok, [head + picked[0]] + picked[1:], spec.input_len, sep="\n")
        sessions.append(single(body, len(tok.encode(body)), spec.output_len))
    return sessions


def sharegpt_sessions(spec: DatasetSpec, tok: TokenCounter, num: int, seed: int) -> list[Session]:
    """First human turn as the prompt; the reply's length (or --sharegpt-output-len) as the output."""
    if not spec.path:
        raise DatasetError("the sharegpt dataset needs --dataset-path (a ShareGPT JSON file)")
    try:
        entries = json.loads(Path(spec.path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read ShareGPT JSON {spec.path}: {exc}") from exc
    pairs = [
        (e["conversations"][0]["value"], e["conversations"][1]["value"])
        for e in entries
        if isinstance(e, dict) and len(e.get("conversations", [])) >= 2
    ]
    random.Random(seed).shuffle(pairs)
    sessions: list[Session] = []
    for prompt, reply in pairs:
        if len(sessions) == num:
            break
        prompt_len = len(tok.encode(prompt))
        out_len = spec.sharegpt_output_len or len(tok.encode(reply))
        # vLLM's filter: drop tiny turns (their TPOT is noise) and very long ones.
        if prompt_len < 4 or out_len < 4 or prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        sessions.append(single(prompt, prompt_len, out_len))
    if len(sessions) < num:
        raise DatasetError(f"{spec.path} has only {len(sessions)} usable conversations, asked for {num}")
    return sessions


_AGENT_HEAD = "You are a coding agent. Use the tools below; answer with one tool call per turn.\nTools:\n"


def agent_sessions(spec: DatasetSpec, tok: TokenCounter, num: int, seed: int) -> list[Session]:
    """`num` conversations of `agent_turns` turns sharing one long system prompt; each turn re-sends all."""
    if spec.agent_turns < 1:
        raise DatasetError("--agent-turns must be at least 1")
    head_len = len(tok.encode(_AGENT_HEAD))
    if spec.agent_system_len <= head_len:
        raise DatasetError(f"--agent-system-len must exceed {head_len} tokens")
    # The system prompt is the same for every conversation and every run with this seed: a cacheable prefix.
    tools, _ = random_text(tok, random.Random(seed ^ 0xA6E7), spec.agent_system_len - head_len)
    system = _AGENT_HEAD + tools
    rng = random.Random(seed)
    sessions = []
    for _ in range(num):
        turns = []
        for _ in range(spec.agent_turns):
            text, n = random_text(tok, rng, _scaled(rng, spec.input_len, spec.range_ratio))
            turns.append(Turn(text, n, _scaled(rng, spec.output_len, spec.range_ratio)))
        sessions.append(Session(tuple(turns), system=system, system_len=len(tok.encode(system))))
    return sessions


def build_sessions(spec: DatasetSpec, tok: TokenCounter, num: int, seed: int) -> list[Session]:
    """`num` sessions (requests; conversations for `agent`) of the named dataset."""
    if num < 0:
        raise DatasetError("--num-prompts must be >= 0")
    if spec.input_len < 1 or spec.output_len < 1:
        raise DatasetError("--input-len and --output-len must be at least 1")
    builders = {
        "random": random_sessions,
        "sonnet": sonnet_sessions,
        "sharegpt": sharegpt_sessions,
        "agent": agent_sessions,
    }
    if spec.name not in builders:
        raise DatasetError(f"unknown dataset {spec.name!r}; choose one of {', '.join(DATASETS)}")
    return builders[spec.name](spec, tok, num, seed) if num else []
