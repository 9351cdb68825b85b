"""What a person opens: the web page at / (chat and server views, static files shipped in the package)
and the JSON it polls: GET /v1/server/status, and GET /v1/server/requests/{id} for one response's
prefill progress while its first token is awaited (under /v1, so --api-key guards them like the API)."""

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
REQUESTS_PATH = "/v1/server/requests"
FAVICON_PATH = "/favicon.ico"  # browsers ask for it unprompted; it is open like the page (app.py)


def model_memory(slot: ModelSlot[ModelServing], used_blocks: int) -> dict[str, int]:
    """A loaded model's bytes: its weights, the KV blocks requests hold now, the pool grown so far (what
    the process holds for it) and the pool's full planned size (its reserved share of the budget)."""
    core = slot.engine.core if slot.engine is not None else None
    report = getattr(core, "memory_report", None)
    parts = report() if callable(report) else {}
    per_block = int(getattr(core, "kv_bytes_per_block", 0) or 0)
    allocated = int(parts.get("kv_pool", 0))
    return {
        "weights_bytes": int(parts.get("weights", 0)),
        "kv_in_use_bytes": min(used_blocks * per_block, allocated),
        "kv_allocated_bytes": allocated,
        "kv_reserved_bytes": max(int(getattr(core, "kv_pool_bytes", 0) or 0), allocated),
    }


def model_status(slot: ModelSlot[ModelServing], info: dict[str, Any]) -> dict[str, Any]:
    """A model's card plus, while loaded, its batch, KV pool, prefix cache and recent speed."""
    out = dict(info)
    serving = slot.serving
    if serving is None:
        return {**out, "running": 0, "waiting": 0, "kv_cache_usage": None, "prefix_cache_hit_rate": None}
    stats = serving.metrics.latest
    hits = stats.prefix_cache_hits / stats.prefix_cache_queries if stats and stats.prefix_cache_queries else None
    used_blocks = stats.num_total_blocks - stats.num_free_blocks if stats else 0
    return {
        **out,
        "memory": model_memory(slot, used_blocks),
        "running": stats.num_running if stats else 0,
        "waiting": stats.num_waiting if stats else 0,
        "kv_cache_usage": round(stats.kv_cache_usage, 4) if stats else 0.0,
        "kv_blocks": {"total": stats.num_total_blocks, "free": stats.num_free_blocks} if stats else None,
        "prefix_cache_hit_rate": None if hits is None else round(hits, 4),
        "num_preemptions": stats.num_preemptions if stats else 0,
        **serving.metrics.window.summary(),
    }


def memory_summary(registry: ModelRegistry[ModelServing], models: list[dict[str, Any]]) -> dict[str, Any]:
    """The process's resident memory split so that the parts add up to it: weights, KV pool in use, KV
    pool grown but free, and other (Python, MLX's buffer cache, allocator slack). The pools' planned size
    beyond what has grown is reserved budget, not resident memory, and is reported apart."""
    rss = process_rss()
    sums = {"weights_bytes": 0, "kv_in_use_bytes": 0, "kv_allocated_bytes": 0, "kv_reserved_bytes": 0}
    for model in models:
        for key, value in (model.get("memory") or {}).items():
            sums[key] += value
    held = sums["weights_bytes"] + sums["kv_allocated_bytes"]
    return {
        "budget_bytes": registry.memory_budget,
        "models_bytes": registry.used_bytes(),  # the models' reserved budget shares (weights + full pools)
        "process_rss_bytes": rss,
        **sums,
        "kv_free_bytes": sums["kv_allocated_bytes"] - sums["kv_in_use_bytes"],
        "kv_not_allocated_bytes": sums["kv_reserved_bytes"] - sums["kv_allocated_bytes"],
        "other_bytes": max(0, rss - held),
    }


def server_status(registry: ModelRegistry[ModelServing], recorder: RequestRecorder, started: float) -> dict[str, Any]:
    infos = registry.describe()
    models = [model_status(slot, info) for slot, info in zip(registry.slots, infos, strict=True)]
    return {
        "version": metalserve.__version__,
        "uptime_s": round(time.monotonic() - started, 1),
        "memory": memory_summary(registry, models),
        "models": models,
        "requests_total": recorder.total,
        "pooling_requests_total": recorder.pooling_total,
        "running_requests": recorder.running(),
        "recent_requests": [r.to_dict() for r in recorder.recent()],
    }


def add_status_routes(app: FastAPI, registry: ModelRegistry[ModelServing], recorder: RequestRecorder) -> None:
    started = time.monotonic()

    @app.get(STATUS_PATH)
    async def status() -> dict[str, Any]:
        return server_status(registry, recorder, started)

    @app.get(REQUESTS_PATH + "/{response_id}")
    async def request_progress(response_id: str) -> dict[str, Any]:
        """A response's engine requests while they run (an empty list once they ended): the page shows
        the prefill's progress from it while the first token is awaited."""
        return {"id": response_id, "requests": recorder.running(response_id)}

    @app.get(FAVICON_PATH, include_in_schema=False)
    async def favicon() -> FileResponse:
        return FileResponse(WEB_DIR / "favicon.ico", media_type="image/x-icon")

    # HEAD too: Claude Code sends `HEAD /` before each run (a 405 there is a needless error in its log).
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
