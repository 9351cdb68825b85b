"""`metalserve serve`: the flags, their mapping onto EngineConfig + ServerSettings, and the uvicorn run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from metalserve.api.app import build_app
from metalserve.api.reasoning import REASONING_PARSERS
from metalserve.api.settings import ServerSettings
from metalserve.api.shutdown import GracefulServer
from metalserve.api.tool_parsers import TOOL_PARSERS
from metalserve.config import ATTENTION_BACKEND_NAMES, CPU_MAX_NUM_BATCHED_TOKENS, EngineConfig
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.engine_thread import EngineThread
from metalserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("metalserve.server")

__all__ = ["ServerSettings", "add_cli_args", "config_from_args", "run_server", "serve_app", "start_engine"]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags (vLLM's names where vLLM has the flag)."""
    d = EngineConfig()
    s = ServerSettings()
    parser.add_argument(
        "model", nargs="?", default=None, help="GGUF file, model directory or hub id (default: embedded)"
    )
    parser.add_argument("--host", default=s.host, help="address to bind (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=s.port)
    parser.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` or `x-api-key: KEY` (not on /health)"
    )
    parser.add_argument("--served-model-name", default=None, help="the model id clients send and see")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests in one batch")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help=f"token budget per step (default: {CPU_MAX_NUM_BATCHED_TOKENS} where MLX runs on the CPU, "
        f"else {d.max_num_batched_tokens})",
    )  # fmt: skip
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy)
    parser.add_argument("--block-size", type=int, choices=[8, 16, 32], default=d.block_size)
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes (overrides the fraction)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
    parser.add_argument("--weights", choices=["auto", "dequantize", "quantized"], default=d.weights)
    parser.add_argument(
        "--attention-backend", choices=list(ATTENTION_BACKEND_NAMES), default=d.attention_backend,
        help="auto, metal (the Metal kernel), cpu (the numba kernel) or mlx (MLX ops; 'reference' is its "
        "deprecated old name)",
    )  # fmt: skip
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None)
    parser.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="vLLM's flag: serve tool_choice 'auto' (given, or implied by tools) through --tool-call-parser, "
        "which it needs; without it such requests get a 400. Forced calls (required, named) need neither",
    )  # fmt: skip
    parser.add_argument(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
        help="split the model's reasoning out: reasoning_content (chat), thinking blocks, reasoning items",
    )  # fmt: skip
    parser.add_argument(
        "--responses-store-size", type=int, default=s.responses_store_size,
        help="responses kept in memory (LRU) for GET /v1/responses/{id} and previous_response_id; 0: none",
    )  # fmt: skip
    parser.add_argument("--log-stats-interval", type=float, default=s.log_stats_interval, help="seconds; 0: off")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
        help="schedule and prepare the next step while this one computes (off by itself, with a start-up "
        "line, for speculative decoding and pipeline stages)",
    )  # fmt: skip
    _add_pipeline_args(parser, d)
    parser.add_argument(
        "--speculative-config", default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}',
    )  # fmt: skip
    _add_http_args(parser, s)


def _add_pipeline_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    parser.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
        help="split the layers over N ranks (MLX distributed); alone it starts N-1 local ranks, under "
        "mlx.launch each host runs one rank and rank 0 serves HTTP",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-layer-partition", default=None,
        help="layers per rank, comma-separated (e.g. 12,18); default: balanced by weight bytes",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-step-timeout", type=float, default=d.pipeline_step_timeout,
        help="seconds to wait for a step's result from the last rank before failing open requests and exiting",
    )  # fmt: skip


def _add_http_args(parser: argparse.ArgumentParser, s: ServerSettings) -> None:
    parser.add_argument(
        "--graceful-shutdown-timeout", type=float, default=s.graceful_shutdown_timeout,
        help="seconds running requests get to finish after SIGTERM/SIGINT; then they end with an error",
    )  # fmt: skip
    parser.add_argument(
        "--max-request-body-bytes", type=int, default=None,
        help="largest request body (413 above it; default: 64 bytes per context token, at least 16 MiB)",
    )  # fmt: skip
    parser.add_argument("--allowed-origins", type=json.loads, default=list(s.allowed_origins), help="CORS, JSON list")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--allowed-methods", type=json.loads, default=list(s.allowed_methods), help="CORS, JSON list")
    parser.add_argument("--allowed-headers", type=json.loads, default=list(s.allowed_headers), help="CORS, JSON list")


def _chat_template(value: str | None) -> str | None:
    """The template from a file, or given inline (anything with a Jinja brace in it)."""
    if value is None:
        return None
    if Path(value).is_file():
        return Path(value).read_text()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template: no such file {value!r}")


def default_token_budget() -> int:
    """The step token budget when the flag is not given: the Platform's (smaller on MLX's CPU backend)."""
    from metalserve.platform import current_platform  # probes MLX once, on the engine's side

    return current_platform().default_token_budget()


def config_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """Map parsed flags onto the two frozen configs (both validate themselves)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))})")
    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=(
            default_token_budget() if args.max_num_batched_tokens is None else args.max_num_batched_tokens
        ),
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        weights=args.weights,
        attention_backend=args.attention_backend,
        chat_template=_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        seed=args.seed,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_layer_partition=_partition(args.pipeline_layer_partition),
        pipeline_step_timeout=args.pipeline_step_timeout,
        speculative_config=(
            SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None
        ),
        async_scheduling=args.async_scheduling,
    )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        log_stats_interval=args.log_stats_interval,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        responses_store_size=args.responses_store_size,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        graceful_shutdown_timeout=args.graceful_shutdown_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        allowed_origins=_string_list(args.allowed_origins, "--allowed-origins"),
        allow_credentials=args.allow_credentials,
        allowed_methods=_string_list(args.allowed_methods, "--allowed-methods"),
        allowed_headers=_string_list(args.allowed_headers, "--allowed-headers"),
    )
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        logger.warning(
            "--tool-call-parser %s without --enable-auto-tool-choice: tool_choice 'auto' (and tools without a "
            "tool_choice) get a 400, as in vLLM", args.tool_call_parser,
        )  # fmt: skip
    return config, settings


def _partition(text: str | None) -> tuple[int, ...] | None:
    from metalserve.distributed.partition import parse_partition  # no MLX

    return parse_partition(text)


def _string_list(value: object, flag: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f'{flag} takes a JSON list of strings, e.g. \'["*"]\'')
    return tuple(value)


def default_model_name(config: EngineConfig, source: str) -> str:
    """The id clients see: the flag, else the model argument, else the embedded file's stem."""
    if config.served_model_name:
        return config.served_model_name
    if config.model:
        return config.model
    return Path(source.split(": ", 1)[-1]).stem


def run_server(config: EngineConfig, settings: ServerSettings) -> None:
    """Load the model, start the engine and serve until SIGINT/SIGTERM."""
    engine = start_engine(config)
    if settings.tool_call_parser is None and config.tool_call_parser:
        settings = dataclasses.replace(settings, tool_call_parser=config.tool_call_parser)
    serve_app(build_app(engine, settings), settings)


def start_engine(config: EngineConfig) -> AsyncEngine:
    """Load the model and build the core on the engine thread, the one that then runs every step: MLX
    arrays belong to the thread that made them (engine/engine_thread.py)."""
    from metalserve.engine.core import EngineCore  # heavy (MLX); only the real server needs it

    thread = EngineThread()
    watchdog = None
    core: EngineCore
    if config.pipeline_parallel_size > 1:
        from metalserve.distributed.serve import start_pipeline  # on ranks other than 0 it serves and exits

        core, loaded, watchdog = thread.call(start_pipeline, config)
    else:
        core, loaded = thread.call(EngineCore.from_config, config)
    engine = AsyncEngine(
        core,
        loaded.tokenizer,
        model_name=default_model_name(config, loaded.source),
        max_model_len=core.max_model_len,  # resolved against the model's context by the core
        eos_token_ids=loaded.eos_token_ids,
        chat_template=loaded.chat_template,
        thread=thread,
    )
    if watchdog is not None:
        watchdog.on_failure = lambda problem: engine.crash(RuntimeError(problem))
    return engine


def serve_app(app: FastAPI, settings: ServerSettings) -> None:
    """Run uvicorn until SIGINT/SIGTERM (a graceful stop, exit 0) or an engine failure (exit 1)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info")
    server = GracefulServer(config, app.state.engine, settings.graceful_shutdown_timeout)
    logger.info("serving on http://%s:%d/v1", settings.host, settings.port)
    server.run()
    if server.engine_failed:
        logger.error("exiting after the engine failed, so a supervisor can restart the server")
        sys.exit(1)
    logger.info("stopped")
