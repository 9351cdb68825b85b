"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names and bodies): adapters loaded and
unloaded at run time, on the engine thread between steps. The API key guards them as every route."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from metalserve.api.errors import OpenAIError
from metalserve.api.model_serving import ModelServing
from metalserve.engine.async_engine import AsyncEngine
from metalserve.lora.files import AdapterError
from metalserve.serving.registry import ModelRegistry, ModelRegistryError


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    model: str | None = None  # the base model to load it over (several models; default: the first)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; the name is what identifies the adapter


def add_lora_routes(app: FastAPI, registry: ModelRegistry[ModelServing]) -> None:
    def engine_of(model: str | None) -> AsyncEngine:
        try:
            engine = registry.resolve(model).engine
        except ModelRegistryError as exc:
            raise OpenAIError(str(exc), exc.status, param="model", code=exc.code) from None
        if engine is None:
            raise OpenAIError(f"the model `{model}` is not loaded", 400, param="model")
        return engine

    @app.post("/v1/load_lora_adapter")
    async def load(req: LoadLoraRequest) -> PlainTextResponse:
        name = req.lora_name.strip()
        if not name:
            raise OpenAIError("lora_name must not be empty", 400, param="lora_name")
        if registry.names_a_model(name):
            raise OpenAIError(f"`{name}` already names a served model", 400, param="lora_name")
        engine = engine_of(req.model)
        try:
            await engine.load_lora(name, req.lora_path)
        except AdapterError as exc:
            raise OpenAIError(str(exc), 400, param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(req: UnloadLoraRequest) -> PlainTextResponse:
        try:
            engine = registry.resolve(req.lora_name).engine
        except ModelRegistryError:
            raise OpenAIError(f"LoRA adapter '{req.lora_name}' is not loaded", 404, param="lora_name") from None
        if engine is None or req.lora_name not in engine.lora_requests():
            raise OpenAIError(f"LoRA adapter '{req.lora_name}' is not loaded", 404, param="lora_name")
        try:
            await engine.unload_lora(req.lora_name)
        except AdapterError as exc:
            raise OpenAIError(str(exc), 400, param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
