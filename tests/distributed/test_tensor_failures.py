"""Tensor-parallel servers fail clearly and stop cleanly, through the real server: a rank killed
mid-stream ends every open stream with an error and the server with status 1 (PP's watchdog and failure
path), SIGTERM stops every rank in order (status 0), and a model whose heads do not split over the ranks
is refused at start-up, naming why. Several processes each: slow (test_tensor_units.py has the fast
twins of the refusals)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from tests.distributed.procs import child_pids, launched_ranks, local_pipeline, serve_cmd
from tests.distributed.test_pipeline_failures import _assert_error_then_exit, _stream_then_break
from tests.distributed.tiny_dir import write_tiny_dir

TP2 = ("--tensor-parallel-size", "2")


def _stream(base: str, results: list[list[str]]) -> None:
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "he said", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
    results.append(events)


@pytest.mark.slow
def test_rank_killed_mid_stream_fails_every_stream(tiny_llama: Path) -> None:
    with local_pipeline(tiny_llama, 1, *TP2) as (proc, base):
        (rank1,) = child_pids(proc.pid)
        others: list[list[str]] = []
        second = threading.Thread(target=_stream, args=(base, others))
        second.start()
        events, seconds = _stream_then_break(base, lambda: os.kill(rank1, signal.SIGKILL))
        second.join(30)
        _assert_error_then_exit(proc, events, seconds)
        # Both streams end with the engine's failure, a 503 in each stream's error event.
        assert others, "the second stream did not end"
        for stream in (events, others[0]):
            errors = [e for e in stream if '"error"' in e]
            assert errors and "503" in errors[-1], stream[-2:]


@pytest.mark.slow
def test_sigterm_stops_every_tensor_parallel_rank(tiny_llama: Path) -> None:
    with local_pipeline(tiny_llama, 1, *TP2) as (proc, base):
        (rank1,) = child_pids(proc.pid)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "the", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # STOP reached rank 1, which exited by itself
        assert not Path(f"/proc/{rank1}").exists() or "Z" in Path(f"/proc/{rank1}/stat").read_text().split()[2]


@pytest.mark.slow
def test_heads_that_do_not_split_are_refused_at_start(tiny_llama: Path) -> None:
    proc = subprocess.run(
        serve_cmd(tiny_llama, "--tensor-parallel-size", "3"), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "--tensor-parallel-size 3: layer 0 has 4 attention heads, not divisible by 3" in proc.stderr


@pytest.mark.slow
def test_launched_ranks_with_other_weights_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    other = write_tiny_dir(tmp_path / "other", "llama", seed=5, layers=4)
    rank0, rank1 = launched_ranks([tiny_llama, other], tmp_path, flag="--tensor-parallel-size")
    assert rank0.returncode == 1 and rank1.returncode == 1
    assert "tensor-parallel rank 1 loaded a different model than rank 0" in rank0.stdout
