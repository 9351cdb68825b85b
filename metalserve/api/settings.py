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
    responses_store_bytes: int = 64 * 1024 * 1024  # and the most bytes (their JSON) they may hold together
    max_grammar_bytes: int = 256 * 1024  # largest structured-output spec (schema, regex, choices, grammar)
    grammar_compile_timeout: float = 10.0  # seconds a grammar may take to compile before its request's 400
    grammar_cache_bytes: int = 64 * 1024 * 1024  # compiled grammars kept (LRU), by their grammar text
    request_body_timeout: float = 30.0  # seconds a request body may take to arrive (408 past it)
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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")
        if self.responses_store_bytes < 0:
            raise ValueError("--responses-store-bytes must be >= 0")
        if self.max_grammar_bytes < 1 or self.grammar_cache_bytes < 0:
            raise ValueError("--max-grammar-bytes must be >= 1 and --grammar-cache-bytes >= 0")
        if self.grammar_compile_timeout <= 0 or self.request_body_timeout <= 0:
            raise ValueError("--grammar-compile-timeout and --request-body-timeout must be > 0")
        if self.log_stats_interval < 0:
            raise ValueError("--log-stats-interval must be >= 0")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be at least 1024")

    def body_limit(self, max_model_len: int) -> int:
        """The request body limit: the flag, else room for a full context of text as JSON (escapes and
        long tokens included) and never under 16 MiB."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return max(MIN_DEFAULT_BODY_BYTES, 64 * max_model_len)
