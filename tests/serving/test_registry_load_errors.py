"""A model load that outlives the request's wait and then fails leaves no unretrieved task exception
(asyncio's "Task exception was never retrieved" with a traceback): its error is logged once, by the load."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

from metalserve.engine.engine_thread import EngineThread
from metalserve.serving.model_spec import ModelSpec
from metalserve.serving.model_thread import LoadedEngine
from metalserve.serving.registry import ModelRegistry, ModelRegistryError
from tests.api.multi_fakes import spec


def test_a_load_failing_after_the_timeout_leaves_no_unretrieved_exception() -> None:
    gate = threading.Event()

    def failing_load(model: ModelSpec, thread: EngineThread) -> LoadedEngine:
        assert gate.wait(30)
        raise RuntimeError("the weights do not fit")

    registry: ModelRegistry[Any] = ModelRegistry(
        [spec("a")],
        failing_load,
        lambda s, e: None,
        memory_budget=None,
        idle_timeout=0.0,
        load_timeout=0.2,
        estimate=lambda s: 1,
    )
    unhandled: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        with pytest.raises(ModelRegistryError, match="not loaded after"):
            await registry.acquire("a")
        gate.set()
        for _ in range(100):  # the load fails on its thread; its task ends with that error
            await asyncio.sleep(0.02)
            if registry.slots[0].load_task is None:
                break
        await asyncio.sleep(0.05)
        gc.collect()  # a finished task nobody awaited reports its exception when collected
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert registry.slots[0].load_task is None
    assert not [c for c in unhandled if "never retrieved" in str(c.get("message"))], unhandled
