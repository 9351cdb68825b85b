"""`metalserve serve`: the flags, generated from EngineConfig + ServerSettings, and the uvicorn run.

To add a flag, add a field to one of the two configs (see metalserve/flags.py); nothing here changes.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from fastapi import FastAPI

from metalserve.api.app import build_app
from metalserve.api.frontend import Frontend
from metalserve.api.header_timeout import HeaderTimeoutProtocol
from metalserve.api.settings import ServerSettings
from metalserve.api.shutdown import GracefulServer
from metalserve.api.startup import serve_while_loading
from metalserve.config import EngineConfig, default_token_budget
from metalserve.flags import add_flags, build, flag_values

logger = logging.getLogger("metalserve.server")

__all__ = [
    "ServerSettings",
    "add_cli_args",
    "config_from_args",
    "default_token_budget",
    "run_server",
    "serve_app",
]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags (vLLM's names where vLLM has the flag): the flag fields of both configs."""
    add_flags(parser, EngineConfig, ServerSettings)


def config_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """Build the two frozen configs from the parsed flags (both validate themselves)."""
    values = flag_values(args, EngineConfig, ServerSettings)
    config, settings = build(EngineConfig, values), build(ServerSettings, values)
    if settings.tool_call_parser and not settings.enable_auto_tool_choice:
        logger.warning(
            "--tool-call-parser %s without --enable-auto-tool-choice: tool_choice 'auto' (and tools without a "
            "tool_choice) get a 400, as in vLLM",
            settings.tool_call_parser,
        )
    return config, settings


def run_server(config: EngineConfig, settings: ServerSettings) -> None:
    """Load the model, start the engine and serve until SIGINT/SIGTERM. Several models: each loads on
    first use, on its own engine thread (docs/multi-model.md)."""
    from metalserve.api.served_models import build_registry  # heavy (MLX); only the real server needs it
    from metalserve.kernels.cpu import gemm, int8_dot

    # Before any model loads: the CPU path's projections read it when they are built.
    if int8_dot.set_mode(settings.cpu_int8_activations):
        logger.info("CPU decode rows dotted in int8 (--cpu-int8-activations %s)", settings.cpu_int8_activations)
    bf16 = settings.cpu_bf16_prefill
    if gemm.set_bf16_mode(bf16):
        if gemm.host_gemm().usable:
            logger.info("CPU prefill GEMMs in bfloat16 (--cpu-bf16-prefill %s)", bf16)
        else:  # the prefill projections take MKL's GEMMs only; without MKL they keep their fp32 loops
            logger.warning("--cpu-bf16-prefill %s: MKL is not loaded here, so prefill stays fp32", bf16)
    frontend = Frontend.of(settings)
    if settings.multi_model or config.world_size > 1:
        # Several models load on first use: the port serves at once. Pipeline stages load first: only rank 0
        # returns from the load to serve HTTP (the other ranks run their stage until the end).
        serve_app(build_app(build_registry(config, settings, frontend), frontend), settings)
        return
    # The port answers from the start: /health is 503 "starting" until the model is loaded and warm.
    serve_while_loading(lambda: build_app(build_registry(config, settings, frontend), frontend), settings)


def serve_app(app: FastAPI, settings: ServerSettings) -> None:
    """Run uvicorn until SIGINT/SIGTERM (a graceful stop, exit 0) or an engine failure (exit 1)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", http=HeaderTimeoutProtocol)
    server = GracefulServer(config, app.state.registry, settings.graceful_shutdown_timeout)
    logger.info("serving on http://%s:%d/v1", settings.host, settings.port)
    server.run()
    if server.engine_failed:
        logger.error("exiting after the engine failed, so a supervisor can restart the server")
        sys.exit(1)
    logger.info("stopped")
