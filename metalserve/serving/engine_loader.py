"""A served model's engine: started for one model (`start_engine`, pipeline stages included) or loaded on
its own engine thread by the registry (`load_engine`), and the size a model is expected to take before its
first load. The core itself is built by serving/build.py."""

from __future__ import annotations

import gc
import struct
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.engine_thread import EngineThread
from metalserve.engine.protocol import SchedulerStatsLike
from metalserve.outputs import EngineCoreOutput
from metalserve.platform import return_freed_memory
from metalserve.request import Request
from metalserve.serving.model_spec import ModelSpec
from metalserve.serving.model_thread import EngineLoader, LoadedEngine
from metalserve.structured.limits import GrammarLimits

if TYPE_CHECKING:
    from metalserve.engine.core import EngineCore
    from metalserve.loader import LoadedModel


class UnloadedCore:
    """What an engine holds after its model was unloaded: nothing to step, every call refused."""

    def _gone(self) -> RuntimeError:
        return RuntimeError("this model was unloaded")

    def add_request(self, request: Request) -> None:
        raise self._gone()

    def abort_requests(self, request_ids: list[str]) -> None:
        pass

    def finish_requests(self, request_ids: list[str]) -> None:
        pass

    def step(self) -> list[EngineCoreOutput]:
        raise self._gone()

    def has_unfinished_requests(self) -> bool:
        return False

    def make_stats(self) -> SchedulerStatsLike:
        raise self._gone()


def start_engine(spec: ModelSpec, grammar_limits: GrammarLimits | None = None) -> AsyncEngine:
    """One model served alone (or as pipeline stages): load it and build its core on a new engine thread,
    the one that then runs every step (MLX arrays belong to the thread that made them)."""
    from metalserve.serving.build import load_engine_core  # heavy (MLX); only a real server needs it

    thread = EngineThread()
    config = spec.config
    if config.world_size == 1:
        core, loaded = thread.call(load_engine_core, config)
        return _engine_of(spec, core, loaded, thread, grammar_limits, images=True)
    # On ranks other than 0 these serve their part and exit.
    from metalserve.serving.pipeline import start_pipeline
    from metalserve.serving.tensor import start_tensor_parallel

    # Tensor parallelism inside pipeline stages runs the pipeline's steps (serving/pipeline.py).
    start = start_tensor_parallel if config.pipeline_parallel_size == 1 else start_pipeline
    core, loaded, watchdog = thread.call(start, config)
    # Distributed ranks run the language model only: images need the single-process engine.
    engine = _engine_of(spec, core, loaded, thread, grammar_limits, images=False)
    watchdog.on_failure = lambda problem: engine.crash(RuntimeError(problem))
    return engine


def engine_loader(grammar_limits: GrammarLimits | None = None) -> EngineLoader:
    """The registry's loader of a served model, with the server's grammar limits."""
    return lambda spec, thread: load_engine(spec, thread, grammar_limits)


def load_engine(spec: ModelSpec, thread: EngineThread, grammar_limits: GrammarLimits | None = None) -> LoadedEngine:
    """Load the model and build its engine core on `thread`, the model's engine thread (the caller)."""
    import mlx.core as mx

    from metalserve.serving.build import load_engine_core

    try:
        core, loaded = load_engine_core(spec.config)
    except BaseException as exc:
        # The error travels on (to the registry's 503, and a while in its records); its traceback's frames
        # would keep the loaded weights alive with it, ~800 MiB per failed load of the default model.
        drop_frames(exc)
        gc.collect()
        mx.clear_cache()
        return_freed_memory()
        raise
    engine = _engine_of(spec, core, loaded, thread, grammar_limits, images=True)
    weights, kv_bytes = core.weight_bytes, core.kv_pool_bytes
    del core, loaded

    def release() -> None:
        engine.core = UnloadedCore()  # the last reference to the core, its pool and the model
        gc.collect()
        mx.clear_cache()
        return_freed_memory()

    return LoadedEngine(engine, weights, kv_bytes, release, thread)


def drop_frames(exc: BaseException) -> None:
    """Clear the local variables of the finished frames in `exc`'s traceback and in those it chains."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def _engine_of(
    spec: ModelSpec,
    core: EngineCore,
    loaded: LoadedModel,
    thread: EngineThread,
    grammar_limits: GrammarLimits | None,
    images: bool,
) -> AsyncEngine:
    return AsyncEngine(
        core,
        loaded.tokenizer,
        model_name=spec.name,
        max_model_len=core.max_model_len,  # resolved against the model's context by the core
        eos_token_ids=loaded.eos_token_ids,
        chat_template=loaded.chat_template,
        thread=thread,
        image_processor=loaded.image_processor if images else None,  # a vision-language model's, else None
        grammar_limits=grammar_limits,
    )


def estimate_bytes(spec: ModelSpec) -> int:
    """Before the first load: the weights (a GGUF that will be dequantized counts its tensors' elements as
    fp32, plus the stored codes the CPU path keeps; other files as stored) and the KV pool given. After the
    load the measured size replaces it; one that does not fit then is undone (the registry's 503)."""
    from metalserve.loader.embedded import default_model_path

    kv = spec.config.kv_cache_memory or 0
    model = spec.config.model
    path = default_model_path() if model is None else Path(model)
    if path.is_file():
        return gguf_weight_bytes(path, spec) + kv
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors")) + kv
    return kv  # a hub id: its size is known once downloaded


def gguf_weight_bytes(path: Path, spec: ModelSpec) -> int:
    from metalserve.config import WeightsMode
    from metalserve.loader.gguf_codes import packed_bytes
    from metalserve.loader.gguf_header import GGUFFormatError, read_header
    from metalserve.loader.load import takes_host_path
    from metalserve.loader.weights_mode import should_dequantize
    from metalserve.platform import current_platform

    stored = path.stat().st_size
    try:
        header = read_header(path)
    except (GGUFFormatError, OSError, struct.error):
        return stored  # the load will say what is wrong with it
    fp32 = 4 * header.num_elements
    platform = current_platform()
    config = spec.config
    if config.weights == WeightsMode.AUTO and platform.host_compute and takes_host_path(path):
        return packed_bytes(header.tensor_types, header.tensor_elements)  # kept in its packed codes
    if should_dequantize(config.weights, fp32, config.dequantize_max_bytes, platform.metal):
        return fp32 + (stored if platform.on_cpu else 0)
    return stored
