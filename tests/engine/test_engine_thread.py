"""The engine thread owns MLX: the server loads, builds and steps on one thread, and a core stepped on
another thread than the one that built it is refused with a clear error instead of MLX's.

The lazily built array here is real: gemma4_text's RoPE table (and YaRN's, Llama 3's) is an MLX array
outside the model's parameters, which loading leaves unevaluated. Made on one thread and evaluated by
a step on another, MLX raises "There is no Stream(cpu, 0) in current thread".
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from metalserve.config import EngineConfig
from metalserve.engine.async_engine import AsyncEngine, EngineDeadError
from metalserve.engine.core import WrongThreadError
from metalserve.engine.engine_thread import EngineThread
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from metalserve.serving.engine_loader import start_engine
from metalserve.serving.model_spec import ModelSpec
from tests.e2e.family_dirs import mlx_lm_model, write_model_dir
from tests.models import golden

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# A KV budget given keeps the warm-up step short (64 tokens): start-up and the first request stay quick.
CONFIG = dict(kv_cache_memory=1 << 22, max_num_batched_tokens=64, max_num_seqs=2)


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("gemma4"), "gemma4_text")


async def _tokens(engine: AsyncEngine, prompt: list[int]) -> list[int]:
    return [t async for out in engine.generate(prompt, GREEDY, "r") for t in out.token_ids]


def test_the_server_start_up_loads_where_the_steps_run(gemma4_dir: Path) -> None:
    """Loaded from this (the test's) thread through the server's start-up, stepped on the engine thread."""
    (prompt,) = golden.prompts([golden.SHORT], 256, seed=4)
    want = golden.reference(mlx_lm_model(gemma4_dir), prompt, GREEDY.max_tokens or 0).tokens

    async def main() -> list[int]:
        engine = start_engine(ModelSpec.of(EngineConfig(model=str(gemma4_dir), **CONFIG)))  # type: ignore[arg-type]
        try:
            return await _tokens(engine, prompt)
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == want


def test_a_lazy_array_made_on_another_thread_fails_in_mlx(gemma4_dir: Path) -> None:
    """Why the rule exists: the loaded model's own table, evaluated by another thread, is MLX's error."""
    from metalserve.loader import load_model

    loaded = load_model(str(gemma4_dir))
    tables = [
        a
        for _, m in loaded.model.named_modules()
        for k, a in m.items()
        if k.startswith("_") and isinstance(a, mx.array)
    ]
    assert tables, "gemma4_text keeps its RoPE table outside the parameters"
    errors: list[BaseException] = []

    def evaluate() -> None:
        try:
            mx.eval(tables)
        except RuntimeError as exc:
            errors.append(exc)

    worker = threading.Thread(target=evaluate)
    worker.start()
    worker.join()
    assert errors and "Stream" in str(errors[0])


def test_a_core_built_on_one_thread_and_stepped_on_another_is_refused(gemma4_dir: Path) -> None:
    from metalserve.loader import load_model

    core = build_engine_core(EngineConfig(**CONFIG), load_model(str(gemma4_dir)))  # type: ignore[arg-type]
    (prompt,) = golden.prompts([golden.SHORT], 256, seed=4)

    async def main() -> None:
        engine = AsyncEngine(core, None, model_name="g", max_model_len=256, eos_token_ids=set())
        with pytest.raises(EngineDeadError):
            await _tokens(engine, prompt)
        assert isinstance(engine.dead_error, WrongThreadError)
        assert "built on thread" in str(engine.dead_error)

    asyncio.run(main())


def test_the_engine_thread_runs_calls_in_order_on_one_thread_and_hands_errors_back() -> None:
    thread = EngineThread()
    seen: list[int] = []
    futures = [thread.submit(lambda i=i: seen.append(i) or threading.get_ident()) for i in range(5)]
    assert {f.result() for f in futures} == {thread.ident} and seen == list(range(5))
    assert thread.call(lambda a, b: a + b, 2, b=3) == 5
    with pytest.raises(SystemExit):  # a pipeline rank's exit reaches the caller
        thread.call(lambda: exec("raise SystemExit(3)"))
    with pytest.raises(ValueError, match="bad"):
        thread.call(lambda: exec("raise ValueError('bad')"))
    assert thread.call(lambda: thread.is_current()) and not thread.is_current()
    thread.close()
    thread._thread.join(timeout=5)
    assert not thread.is_alive()
