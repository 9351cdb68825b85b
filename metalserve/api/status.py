"""What a person opens: the web page at / (chat and server views, static files shipped in the package)
and the JSON it polls, GET /v1/server/status (under /v1, so --api-key guards it like the API)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

import metalserve
from metalserve.api.memory import process_rss
from metalserve.api.request_log import RequestRecorder
from metalserve.serving.registry import ModelRegistry, ModelSlot

if TYPE_CHECKING:
    from metalserve.api.model_serving import ModelServing

WEB_DIR = Path(__file__).parent / "web"
STATUS_PATH = "/v1/server/status"


def model_status(slot: ModelSlot[ModelServing], info: dict[str, Any]) -> dict[str, Any]:
    """A model's card plus, while loaded, its batch, KV pool, prefix cache and recent speed."""
    out = dict(info)
    serving = slot.serving
    if serving is None:
        return {**out, "running": 0, "waiting": 0, "kv_cache_usage": None, "prefix_cache_hit_rate": None}
    stats = serving.metrics.latest
    hits = stats.prefix_cache_hits / stats.prefix_cache_queries if stats and stats.prefix_cache_queries else None
    return {
        **out,
        "running": stats.num_running if stats else 0,
        "waiting": stats.num_waiting if stats else 0,
        "kv_cache_usage": round(stats.kv_cache_usage, 4) if stats else 0.0,
        "kv_blocks": {"total": stats.num_total_blocks, "free": stats.num_free_blocks} if stats else None,
        "prefix_cache_hit_rate": None if hits is None else round(hits, 4),
        "num_preemptions": stats.num_preemptions if stats else 0,
        **serving.metrics.window.summary(),
    }


def server_status(registry: ModelRegistry[ModelServing], recorder: RequestRecorder, started: float) -> dict[str, Any]:
    infos = registry.describe()
    return {
        "version": metalserve.__version__,
        "uptime_s": round(time.monotonic() - started, 1),
        "memory": {
            "budget_bytes": registry.memory_budget,
            "models_bytes": registry.used_bytes(),
            "process_rss_bytes": process_rss(),
        },
        "models": [model_status(slot, info) for slot, info in zip(registry.slots, infos, strict=True)],
        "requests_total": recorder.total,
        "recent_requests": [r.to_dict() for r in recorder.recent()],
    }


def add_status_routes(app: FastAPI, registry: ModelRegistry[ModelServing], recorder: RequestRecorder) -> None:
    started = time.monotonic()

    @app.get(STATUS_PATH)
    async def status() -> dict[str, Any]:
        return server_status(registry, recorder, started)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
