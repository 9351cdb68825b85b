"""Failures end the pipeline server with an error, never a hang: a rank killed mid-stream or while idle,
a rank that stops answering, and start-up errors (another model on one rank, a rank that cannot load).
All slow (several processes each); the default run has their unit twins in test_pipeline_units.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.distributed.procs import child_pids, launched_ranks, local_pipeline, serve_cmd
from tests.distributed.tiny_dir import write_tiny_dir


def _stream_then_break(base: str, break_fn: object) -> tuple[list[str], float]:
    """Stream a long completion; after a few chunks call `break_fn`; return the events and the seconds
    from the break to the end of the stream."""
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "the the", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events: list[str] = []
    broke_at = None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
            if len(events) == 5 and broke_at is None:
                assert callable(break_fn)
                break_fn()
                broke_at = time.monotonic()
    assert broke_at is not None
    return events, time.monotonic() - broke_at


def _assert_error_then_exit(proc: object, events: list[str], seconds: float) -> None:
    assert events[-1] != "[DONE]" or any('"error"' in e for e in events)
    assert any('"error"' in e for e in events[5:]), events[-3:]
    assert seconds < 15
    code = proc.wait(30)  # type: ignore[attr-defined]
    assert code == 1


@pytest.mark.slow
def test_rank_killed_mid_stream(tiny_llama: Path) -> None:
    with local_pipeline(tiny_llama, 2) as (proc, base):
        (rank1,) = child_pids(proc.pid)
        events, seconds = _stream_then_break(base, lambda: os.kill(rank1, signal.SIGKILL))
        _assert_error_then_exit(proc, events, seconds)


@pytest.mark.slow
def test_rank_that_stops_answering(tiny_llama: Path) -> None:
    with local_pipeline(tiny_llama, 2, "--pipeline-step-timeout", "3") as (proc, base):
        (rank1,) = child_pids(proc.pid)
        events, seconds = _stream_then_break(base, lambda: os.kill(rank1, signal.SIGSTOP))
        _assert_error_then_exit(proc, events, seconds)


@pytest.mark.slow
def test_rank_killed_while_idle(tiny_llama: Path) -> None:
    with local_pipeline(tiny_llama, 2) as (proc, _):
        os.kill(child_pids(proc.pid)[-1], signal.SIGKILL)
        assert proc.wait(30) == 1


@pytest.mark.slow
def test_other_model_on_one_rank(tiny_llama: Path, tmp_path: Path) -> None:
    other = write_tiny_dir(tmp_path / "other", "llama", seed=5, layers=4)  # same shapes, other weights
    rank0, rank1 = launched_ranks([tiny_llama, other], tmp_path)
    assert rank0.returncode == 1 and rank1.returncode == 1
    assert "pipeline rank 1 loaded a different model than rank 0" in rank0.stdout


@pytest.mark.slow
def test_rank_that_cannot_load_its_slice(tiny_llama: Path, tmp_path: Path) -> None:
    rank0, rank1 = launched_ranks([tiny_llama, tmp_path / "missing"], tmp_path)
    assert rank0.returncode == 1 and rank1.returncode == 1
    assert "pipeline rank 1 could not start: ModelLoadError" in rank0.stdout


@pytest.mark.slow
def test_bad_layer_partition_is_a_clear_error(tiny_llama: Path) -> None:
    cmd = serve_cmd(tiny_llama, "--pipeline-parallel-size", "2", "--pipeline-layer-partition", "1,9")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert (
        "--pipeline-layer-partition 1,9: needs 2 counts of at least 1 that sum to the model's 4 layers" in proc.stderr
    )


@pytest.mark.slow
def test_sigterm_stops_every_rank_in_order(tiny_llama: Path) -> None:
    with local_pipeline(tiny_llama, 2) as (proc, base):
        (rank1,) = child_pids(proc.pid)
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "the", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # an orderly stop: STOP went down the pipe, the local rank exited
        assert not Path(f"/proc/{rank1}").exists() or "Z" in Path(f"/proc/{rank1}/stat").read_text().split()[2]
