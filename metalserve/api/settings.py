"""How the HTTP server itself is set up (the engine's settings live in EngineConfig).

`metalserve serve`'s server flags are the fields declared with `flag(default, help)`: to add one, add a
field (metalserve/flags.py generates the argument and fills the field from it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from metalserve.flags import flag, flag_group
from metalserve.multimodal.limits import ImageLimits
from metalserve.structured.limits import GrammarLimits

MIN_DEFAULT_BODY_BYTES = 16 * 1024 * 1024


def _tool_parsers() -> list[str]:
    from metalserve.api.tool_parsers import TOOL_PARSERS  # the parsers import the protocol models

    return [*sorted(TOOL_PARSERS), "none"]  # none: no parser, no detection (api/parser_detection.py)


def _reasoning_parsers() -> list[str]:
    from metalserve.api.reasoning import REASONING_PARSERS

    return [*sorted(REASONING_PARSERS), "none"]


# What --override-generation-config may set: the sampling fields a request leaves unset (vLLM's flag).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_config(text: str) -> tuple[tuple[str, float], ...]:
    """--override-generation-config: a JSON object of sampling defaults, as (name, value) pairs."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config takes a JSON object, e.g. '{\"temperature\": 0.7}'")
    for key, number in value.items():
        if key not in GENERATION_DEFAULTS:
            raise ValueError(f"--override-generation-config: {key!r} is not one of {', '.join(GENERATION_DEFAULTS)}")
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"--override-generation-config: {key} must be a number, got {number!r}")
    return tuple((k, float(v)) for k, v in value.items())


def _json_strings(option: str) -> Callable[[str], tuple[str, ...]]:
    """A flag's JSON list of strings, as a tuple."""

    def parse(text: str) -> tuple[str, ...]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{option} takes a JSON list of strings, e.g. '[\"*\"]'")
        return tuple(value)

    return parse


def _names_per_model(uses: list[list[str]]) -> tuple[tuple[str, ...], ...]:
    """--served-model-name's words, one tuple per use of the flag (a model's id, then its aliases)."""
    return tuple(tuple(dict.fromkeys(names)) for names in uses)


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP server: address, API key, tool and reasoning parsers, the Responses store, shutdown, CORS."""

    host: str = flag("127.0.0.1", "address to bind (0.0.0.0 for every interface)")
    port: int = flag(8000, "port to bind")
    api_key: str | None = flag(
        None,
        "require `Authorization: Bearer KEY` or `x-api-key: KEY` (not on /health, /favicon.ico, / and /web/)",
    )
    served_model_name: tuple[tuple[str, ...], ...] = flag(
        (),
        "the model id clients send and see, then its aliases; several models: once per model argument, in order "
        "(`serve A B --served-model-name a --served-model-name b b-alias`)",
        parse=_names_per_model,
        repeated=True,
    )
    log_stats_interval: float = flag(10.0, "seconds between throughput log lines; 0: off")
    tool_call_parser: str | None = flag(
        None,
        "how tool calls are read from the model's text (default: detected from the chat template; none: off)",
        choices=_tool_parsers,
    )
    reasoning_parser: str | None = flag(
        None,
        "split the model's reasoning out: reasoning_content (chat), thinking blocks, reasoning items "
        "(default: detected from the chat template; none: off)",
        choices=_reasoning_parsers,
    )
    responses_store_size: int = flag(
        1000, "responses kept in memory (LRU) for GET /v1/responses/{id} and previous_response_id; 0: none"
    )
    responses_store_bytes: int = flag(
        64 * 1024 * 1024,
        "most bytes (JSON, conversation included) the stored responses hold together; the oldest go first",
    )
    grammar: GrammarLimits = flag_group(GrammarLimits)  # --max-grammar-bytes and the like
    request_body_timeout: float = flag(
        30.0, "seconds a request body may take to arrive after its headers (408 past it, connection closed)"
    )
    default_max_tokens: int = flag(
        4096,
        "output cap for requests that set none (chat, completions with max_tokens null, Responses: Codex "
        "sends none); 0: up to the end of the context",
    )
    override_generation_config: tuple[tuple[str, float], ...] = flag(
        (),
        "vLLM's flag: a JSON object of sampling defaults (temperature, top_p, top_k, min_p, "
        "repetition_penalty) for requests that leave them unset (the APIs' own default is temperature 1)",
        parse=_generation_config,
    )
    generic_tool_prompt: bool = flag(
        True,
        "where the chat template ignores `tools`, describe them in the system message and read calls "
        "back as <tool_call> JSON blocks (docs/agents.md)",
    )
    enable_auto_tool_choice: bool = flag(
        False,
        "vLLM's flag: serve tool_choice 'auto' (given, or implied by tools) through --tool-call-parser, "
        "which it needs; without it such requests get a 400. Forced calls (required, named) need neither",
    )
    cpu_int8_activations: str = flag(
        "off",
        "CPU fast path, every model: decode rows dotted in int8 (llama.cpp's Q8 activations; VNNI where the CPU "
        "has it): faster, not exact; auto = on where the CPU has AVX-512 VNNI (docs/cpu-path.md)",
        choices=("auto", "on", "off"),
    )
    cpu_bf16_prefill: str = flag(
        "off",
        "CPU fast path: prefill projections multiplied in bfloat16 by MKL's GEMM (AMX or AVX-512 BF16 where the "
        "CPU has them), accumulated in fp32: faster, not exact; auto = on where the CPU has either (docs/cpu-path.md)",
        choices=("auto", "on", "off"),
    )
    tool_call_grammar: bool = flag(
        True,
        "under tool_choice 'auto', constrain a call from its opening on to a declared tool with arguments "
        "valid for its schema, text before it free (llama.cpp's lazy grammar; docs/structured-outputs.md)",
    )
    graceful_shutdown_timeout: float = flag(
        30.0, "seconds running requests get to finish after SIGTERM/SIGINT; then they end with an error"
    )
    engine_shutdown_timeout: float = 10.0  # how long shutdown waits for the engine's last step
    max_request_body_bytes: int | None = flag(
        None, "largest request body (413 above it; default: 64 bytes per context token, at least 16 MiB)"
    )
    # Images in (vision-language models): --max-images-per-request and the like.
    images: ImageLimits = flag_group(ImageLimits)
    # CORS, as vLLM's flags and defaults.
    allowed_origins: tuple[str, ...] = flag(("*",), "CORS, JSON list", parse=_json_strings("--allowed-origins"))
    allow_credentials: bool = flag(False, "CORS: allow credentials")
    allowed_methods: tuple[str, ...] = flag(("*",), "CORS, JSON list", parse=_json_strings("--allowed-methods"))
    allowed_headers: tuple[str, ...] = flag(("*",), "CORS, JSON list", parse=_json_strings("--allowed-headers"))
    # Several models (docs/multi-model.md); one model given alone is served as it always was.
    more_models: tuple[str, ...] = flag(
        (), "more models, served beside the first: each loads on first use", positional=True, parse=tuple
    )
    models: str | None = flag(
        None, "a YAML or JSON list of models, each with its path, names/aliases, engine options and `pinned`"
    )
    pinned_models: tuple[str, ...] = flag(
        (), "served models to load at start-up and never unload, comma-separated", parse=_comma_list
    )
    model_idle_timeout: float = flag(
        300.0, "seconds an unused model stays loaded (several models); 0: until memory is needed"
    )
    model_load_timeout: float = flag(600.0, "seconds a request waits for its model to load before a 503")
    memory_budget: int | None = flag(
        None,
        "bytes for every model's weights and KV pool (several models; default: --gpu-memory-utilization "
        "of the machine's memory, less what other programs use)",
    )

    @property
    def multi_model(self) -> bool:
        return bool(self.more_models or self.models)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser == "none":
            raise ValueError(f"--enable-auto-tool-choice needs a tool-call parser ({', '.join(_tool_parsers()[:-1])})")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")
        if self.default_max_tokens < 0:
            raise ValueError("--default-max-tokens must be >= 0 (0: up to the end of the context)")
        if self.responses_store_bytes < 0:
            raise ValueError("--responses-store-bytes must be >= 0")
        if self.request_body_timeout <= 0:
            raise ValueError("--request-body-timeout must be > 0")
        if self.log_stats_interval < 0:
            raise ValueError("--log-stats-interval must be >= 0")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        self._check_models()
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be at least 1024")

    def _check_models(self) -> None:
        if self.model_idle_timeout < 0 or self.model_load_timeout <= 0:
            raise ValueError("--model-idle-timeout must be >= 0 and --model-load-timeout > 0 (seconds)")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError("--memory-budget must be a positive number of bytes")
        if not all(name for names in self.served_model_name for name in names):
            raise ValueError("--served-model-name: names must not be empty")
        if self.pinned_models and not self.multi_model:
            raise ValueError("--pinned-models is for several models (--models, or more than one model argument)")

    def body_limit(self, max_model_len: int) -> int:
        """The request body limit: the flag, else room for a full context of text as JSON (escapes and
        long tokens included) and never under 16 MiB."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return max(MIN_DEFAULT_BODY_BYTES, 64 * max_model_len)
