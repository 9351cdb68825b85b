"""The servers compared: metalserve, mlx-lm's server, llama.cpp's llama-server and llama-cpp-python's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from peers.launch import DEFAULT_GGUF, LLAMA_SERVER, MLX_DIR, PEER_PYTHON, REPO, ServerSpec

SERVERS = ("metalserve", "metalserve-no-async", "mlx-lm", "llama-server", "llama-cpp-python")
# Servers without `ignore_eos` get EOS (<|im_end|>, id 2) and <|endoftext|> (id 0) banned instead, so
# every server produces the same number of tokens.
NO_EOS_BIAS = {"logit_bias": {"0": -100, "2": -100}}
CTX_PER_SLOT = 2048


def metalserve_cmd() -> list[str]:
    script = Path(sys.executable).parent / "metalserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "metalserve.cli"]


def spec_for(name: str, concurrency: int, extra_args: list[str] | None = None) -> ServerSpec:
    """The start command of `name` tuned for `concurrency` clients (llama-server gets that many slots)."""
    extra = extra_args or []
    host = ["--host", "127.0.0.1"]
    if name in ("metalserve", "metalserve-no-async"):  # the second: async scheduling off, for A/B runs
        off = ["--no-async-scheduling"] if name == "metalserve-no-async" else []
        return ServerSpec(name, [*metalserve_cmd(), "serve", "--port", "{port}", *host, *off, *extra])
    if name == "mlx-lm":
        script = str(REPO / "bench" / "peers" / "mlx_lm_server.py")
        argv = [sys.executable, script, "--model", str(MLX_DIR), "--port", "{port}", *host, *extra]
        # Its /v1/models scans the Hugging Face cache (and fails without one): send the name instead.
        return ServerSpec(name, argv, model="default_model", extra_body=NO_EOS_BIAS)
    if name == "llama-server":
        slots = ["--parallel", str(concurrency), "-c", str(CTX_PER_SLOT * concurrency)]
        argv = [
            str(LLAMA_SERVER),
            "-m",
            str(DEFAULT_GGUF),
            "--port",
            "{port}",
            *host,
            "-t",
            "2",
            *slots,
            *extra,
        ]
        return ServerSpec(name, argv)
    if name == "llama-cpp-python":
        argv = [str(PEER_PYTHON), "-m", "llama_cpp.server", "--model", str(DEFAULT_GGUF), "--port", "{port}"]
        argv += [*host, "--n_threads", "2", "--n_ctx", str(CTX_PER_SLOT), *extra]
        return ServerSpec(name, argv, extra_body=NO_EOS_BIAS)
    raise ValueError(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")


def _run(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    return (out.stdout + out.stderr).strip().splitlines()[-1] if out.returncode == 0 else f"error: {out.stderr[-300:]}"


def availability(name: str) -> tuple[bool, str]:
    """Whether `name` can be started here, and its version or the reason it cannot."""
    if name in ("metalserve", "metalserve-no-async"):
        ok = Path(sys.executable).parent.joinpath("metalserve").exists()
        return ok, "metalserve (console script)" if ok else "not installed: .venv/bin/metalserve is missing"
    if name == "mlx-lm":
        if not (MLX_DIR / "config.json").exists():
            return False, f"not converted: run bench/peers/convert_gguf_to_mlx.py (no {MLX_DIR})"
        return True, "mlx-lm " + _run([sys.executable, "-c", "import mlx_lm; print(mlx_lm.__version__)"])
    if name == "llama-server":
        if not LLAMA_SERVER.exists() or not shutil.which(str(LLAMA_SERVER)):
            return False, f"not built: run bench/peers/build_llama_server.sh (no {LLAMA_SERVER})"
        return True, "llama-server " + _run([str(LLAMA_SERVER), "--version"])
    if name == "llama-cpp-python":
        version = _run([str(PEER_PYTHON), "-c", "import llama_cpp; print(llama_cpp.__version__)"])
        if version.startswith("error"):
            return False, f"not installed: run bench/peers/install_llama_cpp_python.sh ({version[:200]})"
        return True, "llama-cpp-python " + version
    raise ValueError(f"unknown server {name!r}")
