"""`metalserve serve`: the flags, generated from EngineConfig + ServerSettings, and the uvicorn run.

To add a flag, add a field to one of the two configs (see metalserve/flags.py); nothing here changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from metalserve.api.app import build_app
from metalserve.api.header_timeout import HeaderTimeoutProtocol
from metalserve.api.settings import ServerSettings
from metalserve.api.shutdown import GracefulServer
from metalserve.api.startup import serve_while_loading
from metalserve.config import EngineConfig, default_token_budget
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.engine_thread import EngineThread
from metalserve.flags import add_flags, build, flag_values

logger = logging.getLogger("metalserve.server")

__all__ = [
    "ServerSettings",
    "add_cli_args",
    "config_from_args",
    "default_token_budget",
    "run_server",
    "serve_app",
    "start_engine",
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


def default_model_name(config: EngineConfig, source: str) -> str:
    """The id clients see: the flag, else the model argument, else the embedded file's stem."""
    if config.served_model_name:
        return config.served_model_name
    if config.model:
        return config.model
    return Path(source.split(": ", 1)[-1]).stem


def run_server(config: EngineConfig, settings: ServerSettings) -> None:
    """Load the model, start the engine and serve until SIGINT/SIGTERM. Several models: each loads on
    first use, on its own engine thread (docs/multi-model.md)."""
    if settings.multi_model:
        from metalserve.api.multi_server import build_registry

        serve_app(build_app(build_registry(config, settings), settings), settings)
        return
    if settings.tool_call_parser is None and config.tool_call_parser:
        settings = dataclasses.replace(settings, tool_call_parser=config.tool_call_parser)
    # The port answers from the start: /health is 503 "starting" until the model is loaded and warm.
    serve_while_loading(lambda: build_app(start_engine(config), settings), settings)


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
        # Pipeline ranks run the language model's layers only: images need the single-process engine.
        image_processor=loaded.image_processor if config.pipeline_parallel_size == 1 else None,
    )
    if watchdog is not None:
        watchdog.on_failure = lambda problem: engine.crash(RuntimeError(problem))
    return engine


def serve_app(app: FastAPI, settings: ServerSettings) -> None:
    """Run uvicorn until SIGINT/SIGTERM (a graceful stop, exit 0) or an engine failure (exit 1)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", http=HeaderTimeoutProtocol)
    server = GracefulServer(config, app.state.engine, settings.graceful_shutdown_timeout)
    logger.info("serving on http://%s:%d/v1", settings.host, settings.port)
    server.run()
    if server.engine_failed:
        logger.error("exiting after the engine failed, so a supervisor can restart the server")
        sys.exit(1)
    logger.info("stopped")
