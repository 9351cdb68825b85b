"""How the HTTP server itself is set up (the engine's settings live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    """Host and port, the optional API key, the public model name and the stats log period."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the engine's model name
    log_stats_interval: float = 10.0  # seconds between throughput log lines; 0 turns them off
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    responses_store_size: int = 1000  # responses kept for GET /v1/responses/{id} and previous_response_id
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (given or implied by tools) needs it
    timeout_graceful_shutdown: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")
        if self.log_stats_interval < 0:
            raise ValueError("--log-stats-interval must be >= 0")
