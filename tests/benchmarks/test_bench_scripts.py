"""The pure parts of the hand-run bench scripts: target ratios, batch shapes, metrics parsing, launching."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import compare_peers  # noqa: E402
import padded_vs_packed  # noqa: E402
import prefix_cache  # noqa: E402
from peers.launch import RunningServer, ServerSpec, ServerStartError  # noqa: E402
from peers.servers import spec_for  # noqa: E402


def _row(server: str, c: int, tput: float, ttft: float, tpot: float) -> dict[str, object]:
    timings = {"output_tok_s": tput, "mean_ttft_s": ttft, "mean_tpot_ms": tpot}
    return {"server": server, "concurrency": c, "completed": 1, "failed": 0, **timings}


def test_targets_compare_metalserve_to_each_peer() -> None:
    rows = [
        _row("metalserve", 8, 100.0, 2.0, 50.0),
        _row("mlx-lm", 8, 40.0, 5.0, 100.0),
        _row("llama-cpp-python", 8, 80.0, 10.0, 20.0),
        _row("metalserve", 1, 30.0, 1.0, 20.0),
        _row("llama-server", 1, 30.0, 1.0, 10.0),
        {"server": "llama-server", "concurrency": 8, "error": "not built"},
    ]
    checks = {t["target"]: t for t in compare_peers.targets(rows)}
    assert checks["c=8 output tok/s vs mlx-lm"]["ratio"] == pytest.approx(2.5)
    assert checks["c=8 output tok/s vs mlx-lm"]["pass"] is True
    assert checks["c=8 output tok/s vs llama-cpp-python"]["pass"] is False
    assert checks["c=8 mean TTFT vs mlx-lm"]["ratio"] == pytest.approx(0.4)
    assert checks["c=1 TPOT vs llama-server"]["ratio"] == pytest.approx(2.0)
    assert checks["c=1 TPOT vs llama-server"]["pass"] is False
    assert checks["c=8 output tok/s vs llama-server --parallel 8"]["ratio"] is None
    md = compare_peers.markdown(rows, list(checks.values()), {"llama-server": "not built"})
    assert "failed: 'not built'" in md and "| 2.50 | >= 2.0 | True |" in md


def test_the_async_ab_server_is_metalserve_with_async_scheduling_off() -> None:
    on, off = spec_for("metalserve", 8).command(0), spec_for("metalserve-no-async", 8).command(0)
    assert "--no-async-scheduling" in off and "--no-async-scheduling" not in on
    assert [x for x in off if x != "--no-async-scheduling"] == on


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "p.png"
    compare_peers.plot([_row("metalserve", 1, 10.0, 1.0, 5.0), _row("metalserve", 2, 18.0, 1.2, 6.0)], path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_padded_batches_have_equal_totals() -> None:
    a = padded_vs_packed.batch_lengths("A", 1024, 16)
    b = padded_vs_packed.batch_lengths("B", 1024, 16)
    assert a == [128] * 8 and b == [912] + [16] * 7 and sum(a) == sum(b)
    with pytest.raises(ValueError, match="too small"):
        padded_vs_packed.batch_lengths("B", 100, 16)


def test_prometheus_parsing_and_ttft_by_turn() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits_total hits\n# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 96.0\n'
        'vllm:prefix_cache_hits_total{model_name="m",engine="1"} 4.0\n'
        'vllm:prefix_cache_queries_total{model_name="m"} 400.0\n'
    )
    totals = prefix_cache.parse_prometheus(text)
    assert totals[prefix_cache.HITS] == 100.0 and totals[prefix_cache.QUERIES] == 400.0
    doc = {"requests": [{"success": True, "turn": t, "ttft_s": v} for t, v in [(0, 1.0), (1, 0.5), (0, 3.0)]]}
    doc["requests"].append({"success": False, "turn": 1, "ttft_s": 9.0})
    assert prefix_cache.ttft_by_turn(doc) == [2.0, 0.5]


def test_server_specs_and_a_failed_start_is_reported(tmp_path: Path) -> None:
    assert "--parallel" in spec_for("llama-server", 8).command(1234)
    assert spec_for("metalserve", 1, ["--no-enable-prefix-caching"]).command(99)[-1] == "--no-enable-prefix-caching"
    with pytest.raises(ValueError, match="unknown server"):
        spec_for("nope", 1)
    spec = ServerSpec("broken", [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"])
    with (
        pytest.raises(ServerStartError, match="exited \\(3\\)[\\s\\S]*bad flag"),
        RunningServer(spec, tmp_path / "l.log"),
    ):
        pass


def test_grammar_bench_shares() -> None:
    import grammar

    s = grammar.summarize([0.100, 0.100, 0.500], [0.120, 0.100, 0.100], [0.002, 0.004], [0.001, 0.001])
    assert s["step_free_ms"] == pytest.approx(100.0) and s["step_json_ms"] == pytest.approx(100.0)
    assert s["mask_ms"] == pytest.approx(3.0) and s["advance_ms"] == pytest.approx(1.0)
    assert s["share_pct"] == pytest.approx(4.0) and s["share_of_free_pct"] == pytest.approx(4.0)
    timer = grammar.Timer()
    timer.wrap(lambda: None)()
    assert timer.take() > 0 and timer.take() == 0


def test_startup_bench_reads_resident_memory() -> None:
    import os

    import startup

    assert 1 < startup.rss_mib(os.getpid()) < 64 * 1024
    assert startup.free_port() > 0


def test_cpu_table_skips_a_prefill_longer_than_the_trained_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default model is trained on 8k tokens: its 16k row is skipped, saying so, not run to fail."""
    import gguf
    from peers import cpu_table

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(8192)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert cpu_table.trained_context(path) == 8192
    ran: list[str] = []
    monkeypatch.setattr(cpu_table, "run_one", lambda server, g, w, a, out: ran.append(w.name) or {"workload": w.name})
    monkeypatch.setattr(cpu_table, "targets", lambda rows: [])

    class Args:
        models = str(path)
        workloads = "prefill4k,prefill16k"

    rows, _ = cpu_table.run_table(Args(), tmp_path)
    assert set(ran) == {"prefill4k"} and "prefill16k skipped" in capsys.readouterr().out


def test_cpu_decode_profile_splits_a_step_of_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/cpu_decode_profile.py on the embedded default model: every projection, the head and the rest,
    for a step of two requests' decode rows."""
    import cpu_decode_profile

    argv = sys.argv
    sys.argv = ["cpu_decode_profile.py", "--context", "32", "--steps", "2", "--requests", "2"]
    try:
        cpu_decode_profile.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "kept in its codes" in out and "2 request(s) at context 32; decode step" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert set(rows) == {"qkv", "o", "gate_up", "down", "head", "rest"}
    assert all(float(cells[0]) > 0 for name, cells in rows.items() if name != "rest")


def test_cpu_int8_dot_bench_times_both_arms() -> None:
    """bench/cpu_int8_dot.py: both arms timed on the same codes; the float one exact, the int8 one close."""
    import cpu_int8_dot

    r = cpu_int8_dot.measure(64, 576, 4, repeat=2, rounds=1)
    assert r["float"] > 0 and r["int8"] > 0
    assert r["float_error"] < 1e-5 and 0 < r["int8_error"] < 2e-2
    eight = cpu_int8_dot.measure(64, 896, 5, repeat=2, rounds=1, tokens=8)  # int8_windows.py's rows
    assert eight["float_error"] < 1e-5 and 0 < eight["int8_error"] < 2e-2


def test_cpu_int8_accuracy_bench_compares_both_modes_with_fp32() -> None:
    """bench/cpu_int8_accuracy.py, one prompt and 4 tokens: the exact path matches fp32, int8 moves a little;
    with --bf16-prefill (a prompt long enough for the GEMM route) bf16 moves the prompt's own step a little."""
    import cpu_int8_accuracy

    results = cpu_int8_accuracy.main(["--prompts", "1", "--tokens", "4"])
    assert results["off"]["steps"] == 3 and results["off"]["max"] < 1e-3
    assert 0 < results["on"]["max"] < 1.0
    assert results["on"]["prompt_max"] < 1e-3  # int8 never touches a prefill
    results = cpu_int8_accuracy.main(["--prompts", "1", "--tokens", "2", "--bf16-prefill"])
    assert results["off"]["prompt_max"] < 1e-3 and results["off"]["prompt_top"] == 1
    assert 0 < results["bf16"]["prompt_max"] < 1.0


class _CharTokenizer:
    """A chat template that is the message itself, a token a character: what own_cases needs of one."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> str:
        return messages[0]["content"]

    def encode(self, text: str, **_: object) -> list[int]:
        return [ord(c) % 100 + 1 for c in text]


def test_cpu_int8_accuracy_bench_takes_another_gguf(tmp_path: Path) -> None:
    """--model: the prompts continued greedily by the GGUF's fp32 self, then both modes against it (a Q6_K
    model, whose 256-wide rows take the int8 bit-plane kernel)."""
    import cpu_int8_accuracy

    from metalserve.kernels.cpu import int8_dot
    from metalserve.loader import load_model
    from tests.executor.test_runner_golden import mlx_lm_greedy
    from tests.loader.gguf_arch_models import write_arch_gguf
    from tests.loader.gguf_blocks import T

    path = tmp_path / "qwen2.gguf"
    write_arch_gguf(path, "qwen2", T.Q6_K)
    fp32 = load_model(str(path), weights="dequantize")
    cases = cpu_int8_accuracy.own_cases(SimpleNamespace(model=fp32.model, tokenizer=_CharTokenizer()), ["ab", "cde"], 4)
    assert [c["prompt_ids"] for c in cases] == [[98, 99], [100, 1, 2]]
    assert all(c["greedy_tokens"] == mlx_lm_greedy(fp32.model, c["prompt_ids"], 4) for c in cases)
    before = int8_dot.enabled()
    try:
        off = cpu_int8_accuracy.compare("off", cases, fp32.model, str(path))
        on = cpu_int8_accuracy.compare("on", cases, fp32.model, str(path))
    finally:
        int8_dot.set_mode("on" if before else "off")
    # int8 off: the float16 rounding of Q6_K's scales alone (2^-11 of each), which this random model's large
    # logits carry to about 1e-2; int8 activations move it further.
    assert off["steps"] == on["steps"] == 6 and off["max"] < 3e-2
    assert off["max"] < on["max"] < 1.0
