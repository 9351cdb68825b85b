"""The CLI end to end against a fake streaming server with known delays (the CI smoke test)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from metalserve.benchmarks.serve import main
from tests.benchmarks.fake_server import FakeBehaviour, FakeServer


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer(FakeBehaviour(ttft_s=0.05, itl_s=0.01)) as s:
        yield s


def _run(server: FakeServer, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    argv = ["--base-url", server.url, "--result-file", str(out), "--disable-tqdm", "--save-detailed", *extra]
    rc = main(argv)
    return rc, json.loads(out.read_text(encoding="utf-8"))


def test_random_completions_counts_timings_and_json(server: FakeServer, tmp_path: Path) -> None:
    rc, doc = _run(
        server,
        tmp_path,
        "--num-prompts",
        "6",
        "--input-len",
        "20",
        "--output-len",
        "5",
        "--max-concurrency",
        "3",
        "--ignore-eos",
        "--num-warmups",
        "2",
    )
    m = doc["metrics"]
    assert rc == 0
    assert (m["completed"], m["failed"]) == (6, 0)
    assert m["total_output_tokens"] == 30 and m["total_input_tokens"] == 120
    # Lower bounds only: the server sleeps at least this long (upper bounds would be timing-flaky).
    assert m["ttft_ms"]["mean"] >= 50.0 and m["itl_ms"]["median"] >= 10.0
    assert m["e2el_ms"]["mean"] >= 50.0 + 4 * 10.0
    assert doc["settings"]["model"] == "fake-model" and doc["settings"]["max_concurrency"] == 3
    assert len(doc["requests"]) == 6 and all(len(r["itl_s"]) == 4 for r in doc["requests"])
    bodies = server.behaviour.bodies
    assert len(bodies) == 8  # two warm-ups first
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"]["include_usage"] for b in bodies)
    assert not {b["prompt"] for b in bodies[:2]} & {b["prompt"] for b in bodies[2:]}


def test_output_tokens_from_tokenizer_without_usage(tmp_path: Path) -> None:
    with FakeServer(FakeBehaviour(ttft_s=0.0, itl_s=0.0, send_usage=False)) as s:
        rc, doc = _run(s, tmp_path, "--endpoint", "chat", "--num-prompts", "3", "--output-len", "4")
    assert rc == 0
    # "tok tok tok tok " counted by the server's /tokenize (one token per word); the role chunk is no token.
    assert doc["metrics"]["total_output_tokens"] == 12
    assert all(len(r["itl_s"]) == 3 for r in doc["requests"])


def test_failures_are_counted(server: FakeServer, tmp_path: Path) -> None:
    rc, doc = _run(server, tmp_path, "--num-prompts", "3", "--extra-body", '{"prompt": "FAIL now"}')
    assert rc == 1
    assert (doc["metrics"]["completed"], doc["metrics"]["failed"]) == (0, 3)
    assert doc["metrics"]["errors"] and doc["metrics"]["errors"][0].startswith("HTTP 500")


def test_poisson_requests_wait_for_their_arrival(server: FakeServer, tmp_path: Path) -> None:
    rc, doc = _run(server, tmp_path, "--num-prompts", "8", "--output-len", "2", "--request-rate", "40", "--seed", "5")
    assert rc == 0
    reqs = doc["requests"]
    arrivals = sorted(r["arrival_s"] for r in reqs)
    assert arrivals[-1] > 0.0 and len(set(arrivals)) == 8
    assert all(r["start_s"] >= r["arrival_s"] for r in reqs)


def test_agent_conversation_grows_by_turns(server: FakeServer, tmp_path: Path) -> None:
    rc, doc = _run(
        server,
        tmp_path,
        "--dataset-name",
        "agent",
        "--endpoint",
        "chat",
        "--num-prompts",
        "2",
        "--agent-turns",
        "3",
        "--agent-system-len",
        "40",
        "--input-len",
        "8",
        "--output-len",
        "3",
    )
    assert rc == 0 and doc["metrics"]["completed"] == 6
    by_first_user: dict[str, list[list[dict[str, str]]]] = {}
    for body in server.behaviour.bodies:
        by_first_user.setdefault(body["messages"][1]["content"], []).append(body["messages"])
    assert len(by_first_user) == 2
    for convo in by_first_user.values():
        assert [len(m) for m in convo] == [2, 4, 6]  # system + user, then + assistant + user per turn
        assert convo[2][:5] == convo[1] + [{"role": "assistant", "content": "tok tok tok "}]
    prompt_lens = sorted(r["prompt_len"] for r in doc["requests"] if r["session"] == 0)
    assert prompt_lens[0] < prompt_lens[1] < prompt_lens[2]


def test_bad_input_is_a_clear_error(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--base-url", server.url, "--endpoint", "embeddings", "--disable-tqdm"]) == 2
    assert "--endpoint must be" in capsys.readouterr().err
    assert main(["--base-url", server.url, "--dataset-name", "sonnet", "--disable-tqdm"]) == 2
    assert "--dataset-path" in capsys.readouterr().err


def test_package_entry_points_parse_the_flags() -> None:
    import argparse

    import metalserve.benchmarks as bench

    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    args = parser.parse_args(["--dataset", "agent", "--request-rate", "2.5", "--max-concurrency", "8"])
    assert (args.dataset_name, args.request_rate, args.max_concurrency) == ("agent", 2.5, 8)
    assert args.request_rate != float("inf") and parser.parse_args([]).request_rate == float("inf")
    assert callable(bench.run_from_args)
