"""Fixtures: the app over a fake core, and a real uvicorn server on a free port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from metalserve.api.app import build_app
from metalserve.api.frontend import Frontend
from metalserve.api.served_models import build_registry
from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from metalserve.engine.async_engine import AsyncEngine
from metalserve.serving.model_spec import ModelSpec
from tests.api.fakes import FakeCore, say_reply, tiny_tokenizer

MODEL = "tiny-model"


@dataclass
class Served:
    app: FastAPI
    core: FakeCore
    engine: AsyncEngine
    url: str = ""


def app_of_engine(engine: AsyncEngine, settings: ServerSettings, config: EngineConfig | None = None) -> FastAPI:
    """The app over an engine built by hand (a fake core, or a core built in the test): a registry of one,
    named by --served-model-name or the engine's model name."""
    frontend = Frontend.of(settings)
    names = settings.served_model_name[0] if settings.served_model_name else (engine.model_name,)
    spec = ModelSpec(names, config if config is not None else EngineConfig())
    return build_app(frontend.registry_of_one(spec, engine), frontend)


def serve_config(config: EngineConfig, settings: ServerSettings) -> Served:
    """`metalserve serve` in this process: the registry as the server builds it (the model loaded on its
    engine thread), and the app over it."""
    frontend = Frontend.of(settings)
    registry = build_registry(config, settings, frontend)
    engine = registry.slots[0].engine
    assert engine is not None
    return Served(build_app(registry, frontend), None, engine)  # type: ignore[arg-type]


def make_served(settings: ServerSettings | None = None, **core_kwargs: Any) -> Served:
    tok = tiny_tokenizer()
    core = FakeCore(tok, core_kwargs.pop("reply", say_reply(tok)), **core_kwargs)
    engine = AsyncEngine(core, tok, model_name=MODEL, max_model_len=core.max_model_len, eos_token_ids={2})
    settings = settings or ServerSettings(tool_call_parser="hermes", enable_auto_tool_choice=True, log_stats_interval=0)
    return Served(app_of_engine(engine, settings), core, engine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def live(served: Served) -> Iterator[Served]:
    """Run the app under uvicorn in a thread (lifespan included) for the duration."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(served.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    served.url = f"http://127.0.0.1:{port}"
    try:
        yield served
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with live(make_served()) as served:
        yield served
