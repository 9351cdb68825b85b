"""`metalserve bench serve`: flags, then warm-up, run, table, JSON. `python -m` runs it too."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from metalserve.benchmarks.client import RequestSettings, endpoint_path
from metalserve.benchmarks.datasets import DATASETS, DatasetError, DatasetSpec, build_sessions
from metalserve.benchmarks.metrics import compute_metrics
from metalserve.benchmarks.report import format_table, result_dict, save_json
from metalserve.benchmarks.runner import RunOptions, run_sessions, warm_up
from metalserve.benchmarks.tokenizer import TokenizerError, make_tokenizer

_WARMUP_SEED_OFFSET = 7919  # warm-up prompts never repeat the measured ones (no prefix-cache help)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register the flags of `bench serve` (names follow `vllm bench serve` where it has them)."""
    srv = parser.add_argument_group("server")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    srv.add_argument("--endpoint", default="completions", help="chat, completions, or a path")
    srv.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    srv.add_argument("--tokenizer", default=None, help="local tokenizer path (default: the server's /tokenize)")
    srv.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    srv.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", "--dataset", default="random", choices=DATASETS)
    data.add_argument("--dataset-path", default=None, help="sonnet text or ShareGPT JSON")
    data.add_argument("--input-len", "--random-input-len", "--sonnet-input-len", type=int, default=256)
    data.add_argument("--output-len", "--random-output-len", "--sonnet-output-len", type=int, default=64)
    data.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0)
    data.add_argument("--prefix-len", "--random-prefix-len", "--sonnet-prefix-len", type=int, default=0)
    data.add_argument("--sharegpt-output-len", type=int, default=None)
    data.add_argument("--agent-turns", type=int, default=4, help="turns per agent conversation")
    data.add_argument("--agent-system-len", type=int, default=1024, help="shared system prompt tokens")
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100, help="requests (conversations for agent)")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals/s, or inf")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--ignore-eos", action="store_true", help="ask for exactly the output length")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    load.add_argument("--disable-tqdm", action="store_true")
    out = parser.add_argument_group("results")
    out.add_argument("--percentiles", default="99", help="comma-separated latency percentiles")
    out.add_argument("--result-file", default=None, help="JSON path (default: bench/results/serve-<time>.json)")
    out.add_argument("--save-detailed", action="store_true", help="also save every request")
    out.add_argument("--label", default=None, help="a name stored with the results")


def discover_model(base_url: str, timeout: float = 30.0) -> str:
    """The first model id of `GET /v1/models`."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise TokenizerError(f"cannot list the server's models at {base_url}/v1/models ({exc}); pass --model") from exc


def _spec(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=args.dataset_name,
        path=args.dataset_path,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        sharegpt_output_len=args.sharegpt_output_len,
        agent_turns=args.agent_turns,
        agent_system_len=args.agent_system_len,
    )


def _percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--percentiles must be numbers in [0, 100], got {text!r}")
    return values


def _run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or discover_model(args.base_url)
    tok = make_tokenizer(args.tokenizer, args.base_url, model)
    settings = RequestSettings(model, endpoint_path(args.endpoint), args.temperature, args.ignore_eos, args.extra_body)
    spec, percentiles = _spec(args), _percentiles(args.percentiles)
    sessions = build_sessions(spec, tok, args.num_prompts, args.seed)
    warmups = build_sessions(spec, tok, args.num_warmups, args.seed + _WARMUP_SEED_OFFSET)
    if warmups and (failed := asyncio.run(warm_up(args.base_url, settings, warmups, args.request_timeout))):
        print(f"warning: {failed} of {len(warmups)} warm-up requests failed", file=sys.stderr)
    opts = RunOptions(args.request_rate, args.max_concurrency, args.seed, args.request_timeout, not args.disable_tqdm)
    records, duration = asyncio.run(run_sessions(args.base_url, settings, sessions, tok, opts))
    metrics = compute_metrics(records, duration, percentiles)
    print(format_table(metrics))
    run_settings = {k: v for k, v in vars(args).items() if not callable(v)} | {
        "model": model,
        "endpoint_path": settings.path,
    }
    doc = result_dict(metrics, run_settings, records if args.save_detailed else None)
    path = args.result_file or f"bench/results/serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
    print(f"results saved to {save_json(doc, Path(path))}")
    return doc


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when at least one request completed, 1 when none did, 2 on bad input."""
    try:
        doc = _run(args)
    except (DatasetError, TokenizerError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    metrics = doc["metrics"]
    return 0 if metrics["completed"] > 0 or args.num_prompts == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metalserve bench serve", description=__doc__)
    add_cli_args(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
