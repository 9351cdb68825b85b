"""Several fake models behind one real server: a loader that builds a FakeCore on the model's engine
thread, with a footprint we choose, a gate to hold a load, and records of loads, threads and releases."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fastapi import FastAPI

from metalserve.api.app import build_app
from metalserve.api.frontend import Frontend
from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.engine_thread import EngineThread
from metalserve.serving.model_spec import ModelSpec
from metalserve.serving.model_thread import LoadedEngine
from metalserve.serving.registry import ModelRegistry
from tests.api.conftest import Served, live
from tests.api.fakes import FakeCore, tiny_tokenizer

MB = 1024 * 1024


def spec(*names: str, pinned: bool = False) -> ModelSpec:
    return ModelSpec(names, EngineConfig(), pinned=pinned)


@dataclass
class FakeModels:
    """The loader the registry calls on each model's engine thread."""

    footprints: dict[str, int]
    step_delay: float = 0.0
    gates: dict[str, threading.Event] = field(default_factory=dict)
    loads: collections.Counter[str] = field(default_factory=collections.Counter)
    load_threads: dict[str, int] = field(default_factory=dict)
    release_threads: dict[str, int] = field(default_factory=dict)
    cores: dict[str, FakeCore] = field(default_factory=dict)

    def load(self, model: ModelSpec, thread: EngineThread) -> LoadedEngine:
        name = model.name
        self.loads[name] += 1
        gate = self.gates.get(name)
        if gate is not None:
            assert gate.wait(30), "the test never opened the load gate"
        tok = tiny_tokenizer()
        core = FakeCore(tok, f"I am {name}.", step_delay=self.step_delay)
        self.cores[name] = core
        self.load_threads[name] = threading.get_ident()
        engine = AsyncEngine(
            core, tok, model_name=name, max_model_len=core.max_model_len, eos_token_ids={2}, thread=thread
        )

        def release() -> None:
            self.release_threads[name] = threading.get_ident()

        return LoadedEngine(engine, weight_bytes=self.footprints[name], release=release, thread=thread)


class Registered(NamedTuple):
    registry: ModelRegistry[Any]
    frontend: Frontend


def make_registry(
    fakes: FakeModels,
    specs: list[ModelSpec],
    budget: int | None,
    idle_timeout: float = 0.0,
    load_timeout: float = 30,
    settings: ServerSettings | None = None,
) -> Registered:
    """The registry over fake models, made with the frontend's hooks as the server makes it."""
    frontend = Frontend.of(settings or ServerSettings(log_stats_interval=0))
    registry: ModelRegistry[Any] = ModelRegistry(
        specs,
        fakes.load,
        frontend.make_serving,
        on_unload=frontend.model_unloaded,
        memory_budget=budget,
        idle_timeout=idle_timeout,
        load_timeout=load_timeout,
        estimate=lambda s: fakes.footprints[s.name],
    )
    return Registered(registry, frontend)


@contextmanager
def serving(registered: Registered) -> Iterator[str]:
    """The registry's app under uvicorn in a thread; yields its base URL."""
    app: FastAPI = build_app(*registered)
    with live(Served(app, None, None)) as served:  # type: ignore[arg-type]
        yield served.url
