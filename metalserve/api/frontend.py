"""What every served model's routes share (the settings, the Responses store, the metric series, the
request recorder) and how a loaded model gets its serving classes. Built before the registry, so the
registry is handed its hooks when it is made (serving/registry.py) and build_app receives it ready."""

from __future__ import annotations

from dataclasses import dataclass, field

from metalserve.api.metrics import MetricSeries
from metalserve.api.model_serving import ModelServing, ServingOptions, make_model_serving
from metalserve.api.request_log import RequestRecorder
from metalserve.api.responses.store import ResponseStore
from metalserve.api.settings import ServerSettings
from metalserve.engine.async_engine import AsyncEngine
from metalserve.serving.model_spec import ModelSpec
from metalserve.serving.registry import ModelRegistry


@dataclass
class Frontend:
    settings: ServerSettings
    store: ResponseStore
    series: MetricSeries = field(default_factory=MetricSeries)
    recorder: RequestRecorder = field(default_factory=RequestRecorder)

    @classmethod
    def of(cls, settings: ServerSettings) -> Frontend:
        return cls(settings, ResponseStore(settings.responses_store_size, settings.responses_store_bytes))

    def make_serving(self, spec: ModelSpec, engine: AsyncEngine) -> ModelServing:
        """A loaded model's serving classes, with its own parsers (or the server's)."""
        settings = self.settings
        options = ServingOptions(
            spec.names,
            spec.config.tool_call_parser or settings.tool_call_parser,
            spec.reasoning_parser or settings.reasoning_parser,
            spec.enable_auto_tool_choice or settings.enable_auto_tool_choice,
            settings.images,
            settings.default_max_tokens,
            settings.generic_tool_prompt,
            settings.tool_call_grammar,
            dict(settings.override_generation_config),
        )
        serving = make_model_serving(engine, options, self.store, self.series, self.recorder)
        self.series.loaded.labels(spec.name).set(1)
        return serving

    def model_unloaded(self, spec: ModelSpec) -> None:
        self.series.model_unloaded(spec.name)

    def registry_of_one(self, spec: ModelSpec, engine: AsyncEngine) -> ModelRegistry[ModelServing]:
        """One model, loaded already: a registry of one."""
        return ModelRegistry.of_one(spec, engine, self.make_serving, self.model_unloaded)
