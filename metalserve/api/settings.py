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
    # The output cap for requests that set none (chat, completions with max_tokens null, Responses; a
    # Messages request always sets one). Agents such as Codex send none; 0: up to the end of the context.
    default_max_tokens: int = 4096
    # Where the chat template ignores `tools`, describe them in the system message in a generic form
    # (api/generic_tools.py) and read calls back with the generic parser; False: leave them out.
    generic_tool_prompt: bool = True
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
        if self.default_max_tokens < 0:
            raise ValueError("--default-max-tokens must be >= 0 (0: up to the end of the context)")
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
