"""How the HTTP server itself is set up (the engine's settings live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

MIN_DEFAULT_BODY_BYTES = 16 * 1024 * 1024


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
    # SIGTERM/SIGINT: running requests get this long to finish; what is left then ends with an error.
    graceful_shutdown_timeout: float = 30.0
    engine_shutdown_timeout: float = 10.0  # how long shutdown waits for the engine's last step
    max_request_body_bytes: int | None = None  # None: derived from the context length (body_limit)
    # CORS, as vLLM's flags and defaults.
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    # Several models (metalserve/engine/registry.py); one model given alone is served as it always was.
    models: tuple[str, ...] = ()  # the model arguments, when there are several
    models_file: str | None = None  # --models: a YAML or JSON list of models with their own options
    pinned_models: tuple[str, ...] = ()  # --pin: loaded at start-up and never unloaded
    model_idle_timeout: float = 300.0  # seconds a model may sit idle before it is unloaded; 0: never
    model_load_timeout: float = 600.0  # seconds a request waits for its model to load before a 503
    memory_budget: int | None = None  # bytes for every model's weights and KV pool; None: see docs

    @property
    def multi_model(self) -> bool:
        return bool(self.models or self.models_file)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")
        if self.log_stats_interval < 0:
            raise ValueError("--log-stats-interval must be >= 0")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        if self.model_idle_timeout < 0 or self.model_load_timeout <= 0:
            raise ValueError("--model-idle-timeout must be >= 0 and --model-load-timeout > 0 (seconds)")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError("--memory-budget must be a positive number of bytes")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be at least 1024")

    def body_limit(self, max_model_len: int) -> int:
        """The request body limit: the flag, else room for a full context of text as JSON (escapes and
        long tokens included) and never under 16 MiB."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return max(MIN_DEFAULT_BODY_BYTES, 64 * max_model_len)
